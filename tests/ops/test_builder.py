"""The builder: many processes starting together build once and all load the result; CUDA sources compile."""

import os
import shutil
import subprocess
import sys

import pytest

from mm_adaptor.ops import builder

LOAD_AND_USE = ("import torch, mm_adaptor.ops as o\n"
                "y = o.swiglu(torch.ones(2, 4))\n"
                "s = o.library.status()['cpu']\n"
                "assert s['native'], s\n"
                "print('LOADED', s['why'])\n")


def test_concurrent_processes_build_once_and_all_load(tmp_path):
    env = dict(os.environ, MM_ADAPTOR_OPS_CACHE=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_AND_USE], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outputs = [p.communicate(timeout=900) for p in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-2000:]
        assert "LOADED native cpu kernels" in out
    builds = (tmp_path / "builds.log").read_text().splitlines()
    assert len(builds) == 1, builds
    assert sum("building native cpu ops" in err for _, err in outputs) == 1


def test_cache_key_follows_sources_and_torch(monkeypatch, tmp_path):
    key = builder.cache_key("cpu")
    fake = tmp_path / "csrc"
    shutil.copytree(builder.CSRC, fake)
    monkeypatch.setattr(builder, "CSRC", fake)
    assert builder.cache_key("cpu") == key
    (fake / "cpu" / "rms_norm.cpp").write_text((fake / "cpu" / "rms_norm.cpp").read_text() + "\n// x\n")
    assert builder.cache_key("cpu") != key


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")
@pytest.mark.parametrize("source", sorted(p.name for p in (builder.CSRC / "cuda").glob("*.cu")))
def test_cuda_sources_compile_with_nvcc(source, tmp_path):
    """Compile-check only (nothing CUDA runs here): each .cu against the installed torch headers."""
    import sysconfig

    import torch.utils.cpp_extension as ext

    includes = [f"-I{p}" for p in ext.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    # A CPU build of torch ships the CUDA headers without the generated c10/cuda/impl/cuda_cmake_macros.h.
    cmd = [NVCC, "-c", *builder.NVCC_FLAGS, "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", "--expt-relaxed-constexpr",
           "-diag-suppress=3306", *includes, str(builder.CSRC / "cuda" / source), "-o", str(tmp_path / "out.o")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "out.o").stat().st_size > 0
