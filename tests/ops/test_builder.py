"""The builder: many processes starting together build once and all load the result; CUDA sources compile."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mm_adaptor.ops import builder

LOAD_AND_USE = ("import torch, mm_adaptor.ops as o\n"
                "y = o.swiglu(torch.ones(2, 4))\n"
                "s = o.library.status()['cpu']\n"
                "assert s['native'], s\n"
                "print('LOADED', s['why'])\n")
# A TORCH_CHECK inside the native library (grouped_matmul's counts, past the Python-side check): a RuntimeError that
# names the C++ source, never a signal (issue 53: it killed the process with SIGSEGV on one GPU machine).
NATIVE_ERROR = ("import sys, torch, mm_adaptor.ops as o\n"
                "device = sys.argv[1] if len(sys.argv) > 1 else 'cpu'\n"
                "o.library.ensure(device)\n"
                "assert o.library.status()[device]['native'], o.library.status()\n"
                "x, w = torch.randn(5, 3, device=device), torch.randn(2, 3, 4, device=device)\n"
                "try:\n"
                "    o.library.op('grouped_matmul_fwd')(x, w, torch.tensor([1, 3]))\n"
                "except RuntimeError as e:\n"
                "    print('RAISED', 'grouped_matmul.cpp' in str(e), str(e).splitlines()[0])\n")


# c10's message then names the source and line of the TORCH_CHECK (the reference raises the same words in Python)
NAMES_THE_SOURCE = {"TORCH_SHOW_CPP_STACKTRACES": "1", "TORCH_DISABLE_ADDR2LINE": "1"}


def assert_native_error_raised(out: str) -> None:
    assert "RAISED True grouped_matmul: tokens_per_expert sums to 4 but x has 5 rows" in out, out


def test_concurrent_processes_build_once_and_all_load(tmp_path):
    """Where the suite's own cache has no CPU library yet (a clean clone; conftest runs this test first), the four
    processes build into it, and that one build is what every later test loads; otherwise into a fresh folder."""
    root = builder.cache_root() if builder.cached_library("cpu") is None else tmp_path
    log = root / "builds.log"
    earlier = len(log.read_text().splitlines()) if log.exists() else 0
    env = dict(os.environ, MM_ADAPTOR_OPS_CACHE=str(root), **NAMES_THE_SOURCE)
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_AND_USE + NATIVE_ERROR], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outputs = [p.communicate(timeout=900) for p in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-2000:]
        assert "LOADED native cpu kernels" in out
        assert_native_error_raised(out)
    builds = log.read_text().splitlines()[earlier:]
    assert len(builds) == 1, builds
    recorded = json.loads((root / f"cpu-{builder.cache_key('cpu')}" / "build.json").read_text())
    assert recorded == builder.build_info("cpu"), recorded
    assert sum("building native cpu ops" in err for _, err in outputs) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (scripts/gpu_session.sh runs it on one)")
def test_a_native_error_in_the_cuda_library_is_a_runtime_error():
    done = subprocess.run([sys.executable, "-c", NATIVE_ERROR, "cuda"], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, **NAMES_THE_SOURCE))
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert_native_error_raised(done.stdout)


def test_the_instruction_set_is_an_explicit_level_in_the_key_and_the_build_is_recorded(monkeypatch):
    """No -march=native (a cached build may move between machines): the highest x86-64 level the CPU lists, all
    lower levels' features included; the key changes with it; report shows the compiler and flags."""
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    v2 = "cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3"
    v3 = v2 + " avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"
    assert builder.isa_flags(v3 + " avx512f avx512bw avx512cd avx512dq avx512vl") == ["-march=x86-64-v4"]
    assert builder.isa_flags(v3 + " avx512f") == ["-march=x86-64-v3"]
    assert builder.isa_flags(v3.replace(" popcnt", "")) == ["-march=x86-64"], "v3 needs v2's features too"
    assert builder.isa_flags(v2) == ["-march=x86-64-v2"]
    monkeypatch.setattr(builder, "_cpu_features", lambda: "flags : " + v2)
    key = builder.cache_key("cpu")
    assert not any("native" in flag for flag in builder.cxx_flags("cpu")), builder.cxx_flags("cpu")
    monkeypatch.setattr(builder, "_cpu_features", lambda: "flags : " + v3)
    assert builder.cache_key("cpu") != key
    monkeypatch.setenv(builder.DROP_FLAGS_ENV, "-fopenmp")
    assert "-fopenmp" not in builder.cxx_flags("cpu")
    info = builder.build_info("cpu")
    assert info["cxx_flags"] == " ".join(builder.cxx_flags("cpu")) and info["compiler"], info


def test_cache_key_follows_sources_and_torch(monkeypatch, tmp_path):
    key = builder.cache_key("cpu")
    fake = tmp_path / "csrc"
    shutil.copytree(builder.CSRC, fake)
    monkeypatch.setattr(builder, "CSRC", fake)
    assert builder.cache_key("cpu") == key
    (fake / "cpu" / "rms_norm.cpp").write_text((fake / "cpu" / "rms_norm.cpp").read_text() + "\n// x\n")
    assert builder.cache_key("cpu") != key


def test_cuda_key_follows_nvcc_architectures_and_headers(monkeypatch, tmp_path):
    monkeypatch.setattr(builder, "compiler", lambda device: "c++ (test)")
    monkeypatch.setattr(builder, "nvcc_version", lambda: "Cuda compilation tools, release 13.0")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    key = builder.cache_key("cuda")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    assert builder.cache_key("cuda") != key
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setattr(builder, "nvcc_version", lambda: "Cuda compilation tools, release 12.8")
    assert builder.cache_key("cuda") != key
    monkeypatch.setattr(builder, "nvcc_version", lambda: "Cuda compilation tools, release 13.0")
    fake = tmp_path / "csrc"
    shutil.copytree(builder.CSRC, fake)
    monkeypatch.setattr(builder, "CSRC", fake)
    assert builder.cache_key("cuda") == key
    header = fake / "cuda" / "vectorized.cuh"
    header.write_text(header.read_text() + "\n// x\n")
    assert builder.cache_key("cuda") != key


def test_a_failed_build_publishes_nothing(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as ext

    def half_written(name, build_directory, **_):
        (tmp_path / "private").write_text(build_directory)
        (builder.Path(build_directory) / f"{name}.so").write_bytes(b"\x7fELF truncated")
        raise RuntimeError("linker killed")

    monkeypatch.setenv(builder.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(ext, "load", half_written)
    with pytest.raises(builder.BuildUnavailable, match="linker killed"):
        builder.build("cpu")
    assert builder.cached_library("cpu") is None
    assert not builder.Path((tmp_path / "private").read_text()).exists()


FALLS_BACK = ("import importlib, warnings, torch, mm_adaptor.ops as o\n"
              "rms_norm = importlib.import_module('mm_adaptor.ops.rms_norm')\n"
              "with warnings.catch_warnings(record=True) as caught:\n"
              "    warnings.simplefilter('always')\n"
              "    x, w = torch.randn(3, 8), torch.randn(8)\n"
              "    y = o.rms_norm(x, w)\n"
              "    o.swiglu(torch.randn(2, 4))\n"
              "assert torch.equal(y, rms_norm.reference_fwd(x, w, 1e-5)[0])\n"
              "s = o.library.status()['cpu']\n"
              "assert not s['native'] and 'does not load' in s['why'], s\n"
              "print('WARNINGS', len([c for c in caught if 'references run instead' in str(c.message)]))\n")


def test_a_library_that_does_not_load_falls_back_to_the_references_with_one_warning(tmp_path):
    env = dict(os.environ, MM_ADAPTOR_OPS_CACHE=str(tmp_path))
    env.pop("PYTHONWARNINGS", None)
    key = builder.cache_key("cpu")
    (tmp_path / f"cpu-{key}").mkdir()
    (tmp_path / f"cpu-{key}" / "mm_adaptor_ops_cpu.so").write_bytes(b"not a shared library")
    done = subprocess.run([sys.executable, "-c", FALLS_BACK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNINGS 1" in done.stdout, done.stdout


NVCC = shutil.which("nvcc")
CUDA_SOURCES = sorted(p.name for p in (builder.CSRC / "cuda").glob("*.cu"))


def unity_source(folder: Path, cuda: Path = builder.CSRC / "cuda", sources=tuple(CUDA_SOURCES)) -> Path:
    """Every .cu in one translation unit, each in a namespace of its own (their file-local names repeat), after the
    union of their #includes: the torch headers, most of a file's compile time, are parsed once instead of six
    times. What it cannot see: a file that lacks an #include another file has."""
    headers: list[str] = []
    for source in sources:
        for line in (cuda / source).read_text().splitlines():
            if line.startswith("#include"):
                local = line.split('"')[1] if '"' in line else None
                line = f'#include "{(cuda / local).resolve()}"' if local else line
                if line not in headers:
                    headers.append(line)
    wrapped = [f'namespace unity_{i} {{\n#include "{cuda / source}"\n}}' for i, source in enumerate(sources)]
    path = folder / "all_cuda_sources.cu"
    path.write_text("\n".join(headers + wrapped) + "\n")
    return path


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")
def test_cuda_sources_compile_with_nvcc(tmp_path):
    """Compile-check only (nothing CUDA runs here), against the installed torch headers: the builder's flags without
    optimisation (host and device), 20% faster. --cuda runs every CUDA phase (the front end over host and device
    code, cicc, ptxas) and leaves out the host compiler's second parse of the translated host code (5-12 s)."""
    import sysconfig

    import torch.utils.cpp_extension as ext

    includes = [f"-I{p}" for p in ext.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    flags = ["-O0" if flag == "-O3" else flag for flag in builder.NVCC_FLAGS] + ["-Xptxas", "-O0"]
    # A CPU build of torch ships the CUDA headers without the generated c10/cuda/impl/cuda_cmake_macros.h.
    cmd = [NVCC, "--cuda", *flags, "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", "--expt-relaxed-constexpr",
           "-diag-suppress=3306", *includes, str(unity_source(tmp_path)), "-o", str(tmp_path / "all.ii")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "fatbinData" in (tmp_path / "all.ii").read_text()  # the device code compiled, embedded in the host code


def test_the_compile_check_sees_every_cuda_source_and_its_errors(tmp_path):
    """The one translation unit holds each source; an error in one is reported under that file's name."""
    text = unity_source(tmp_path).read_text()
    assert all(f"/{source}\"" in text for source in CUDA_SOURCES) and len(CUDA_SOURCES) >= 6
    if NVCC is None:
        pytest.skip("nvcc is not installed on this machine")
    (tmp_path / "good.cu").write_text("#include <cstdint>\nint f() { return 1; }\n")
    (tmp_path / "bad.cu").write_text("#include <cstdint>\nint f() { return undeclared_name; }\n")
    unity = unity_source(tmp_path, cuda=tmp_path, sources=("good.cu", "bad.cu"))
    done = subprocess.run([NVCC, "-c", str(unity), "-o", str(tmp_path / "bad.o")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "bad.cu" in done.stderr and "undeclared_name" in done.stderr


def test_every_native_source_is_packaged():
    """A non-editable install carries only what pyproject's package-data names: each csrc file must match."""
    import fnmatch
    import tomllib

    project = tomllib.loads((builder.CSRC.parents[1] / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["package-data"]["mm_adaptor.ops"]
    files = [p.relative_to(builder.CSRC.parent).as_posix() for p in builder.CSRC.rglob("*") if p.is_file()]
    assert files
    unpackaged = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in patterns)]
    assert not unpackaged, f"add these to package-data in pyproject.toml: {unpackaged}"
