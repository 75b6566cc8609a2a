"""Builds the native ops library just in time (or ahead of time with `mm-adaptor build-ops`).

The build is cached under a key made of the torch version, the compiler (and for CUDA the nvcc version and
the GPU architectures built for), the Python ABI, the flags, the sources and their headers, and guarded by an
exclusive file lock, so that many ranks starting at once build once and the others wait and load the result.
A lock held by a process that dies is released by the OS. The library is built in a private directory and
published by an atomic rename, so no process ever sees a half-written library.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mm_adaptor.core.cache import user_cache

CACHE_ENV = "MM_ADAPTOR_OPS_CACHE"
CSRC = Path(__file__).resolve().parent / "csrc"
# No -march=native: a cached build may move between machines (a shared cache, a copied venv), so the instruction
# set is an explicit x86-64 level the CPU has (isa_flags), which is part of the cache key; the compiler and every
# flag are recorded beside the library (build.json) and shown by `mm-adaptor report`.
CXX_FLAGS = ["-O3", "-std=c++20", "-fopenmp", "-fno-trapping-math"]
# x86-64 micro-architecture levels (the psABI's), highest first: what /proc/cpuinfo must list for each
X86_64_LEVELS = (
    ("x86-64-v4", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    ("x86-64-v3", {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}),
    ("x86-64-v2", {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}),
)
NVCC_FLAGS = ["-O3", "-std=c++20", "--use_fast_math", "-U__CUDA_NO_HALF_OPERATORS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF_CONVERSIONS__"]


class BuildUnavailable(RuntimeError):
    """No compiler or toolkit: the reference implementations run instead."""


@dataclass
class BuildResult:
    device: str
    library: Path
    built_now: bool
    seconds: float


def cache_root() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    return user_cache("ops")


DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def sources(device: str) -> list[Path]:
    """The device's own kernels, then the device-generic ATen code in csrc/common built into every library."""
    suffix = ".cu" if device == "cuda" else ".cpp"
    return sorted((CSRC / device).glob(f"*{suffix}")) + sorted((CSRC / "common").glob("*.cpp"))


def headers(device: str) -> list[Path]:
    return sorted(p for folder in (CSRC / device, CSRC / "common") for pattern in ("*.h", "*.cuh")
                  for p in folder.glob(pattern))


def isa_flags(cpu_flags: str | None = None) -> list[str]:
    """The highest x86-64 level whose features this CPU lists (v2 needs v1's, and so on), or none elsewhere."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    listed = set((cpu_flags if cpu_flags is not None else _cpu_features()).split())
    for index, (level, _) in enumerate(X86_64_LEVELS):
        if all(needs <= listed for _, needs in X86_64_LEVELS[index:]):
            return [f"-march={level}"]
    return ["-march=x86-64"]


# Flags left out of a build, space-separated (a diagnosis: scripts/gpu_session.sh native-errors builds without -fopenmp)
DROP_FLAGS_ENV = "MM_ADAPTOR_OPS_DROP_FLAGS"


def cxx_flags(device: str) -> list[str]:
    dropped = set(os.environ.get(DROP_FLAGS_ENV, "").split())
    flags = [*CXX_FLAGS, *isa_flags(), f"-DMM_ADAPTOR_DISPATCH_KEY={DISPATCH_KEYS[device]}"]
    return [flag for flag in flags if flag not in dropped]


def recorded_build(device: str) -> dict:
    """The build.json of the cached library where one is built, else what a build here would use."""
    if device == "cuda" and not torch.cuda.is_available():
        raise BuildUnavailable("no CUDA device")
    cached = cached_library(device)
    record = cached.parent / "build.json" if cached else None
    if record is not None and record.is_file():
        return json.loads(record.read_text())
    return build_info(device)


def build_info(device: str) -> dict:
    """What builds (or built) the library: the compiler and its flags (and nvcc's, for CUDA)."""
    info = {"compiler": compiler(device), "cxx_flags": " ".join(cxx_flags(device))}
    if device == "cuda":
        info.update(nvcc=nvcc_version(), nvcc_flags=" ".join(NVCC_FLAGS), architectures=cuda_architectures())
    return info


def compiler(device: str) -> str:
    exe = os.environ.get("CXX", "c++")
    if shutil.which(exe) is None:
        raise BuildUnavailable(f"no C++ compiler ({exe!r} not found; set CXX)")
    if device == "cuda":
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None or not torch.cuda.is_available():
            raise BuildUnavailable("no CUDA toolkit or no CUDA device for the CUDA kernels")
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildUnavailable(f"cannot run the C++ compiler {exe!r}: {exc}") from exc
    return version.splitlines()[0] if version else exe


def cuda_architectures() -> str:
    """What torch's extension builder compiles for: TORCH_CUDA_ARCH_LIST, else the visible GPUs' capabilities."""
    configured = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if configured:
        return configured
    if not torch.cuda.is_available():
        return "no visible GPU"
    return ";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}))


def nvcc_version() -> str:
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError, TypeError) as exc:
        raise BuildUnavailable(f"cannot run nvcc ({nvcc}): {exc}") from exc
    return out.strip().splitlines()[-1] if out.strip() else "unknown nvcc"


def key_parts(device: str) -> list[str]:
    parts = [torch.__version__, str(torch.version.cuda), sys.version, compiler(device),
             " ".join(cxx_flags(device) + NVCC_FLAGS)]
    if device == "cpu":
        parts.append("one translation unit")
    if device == "cuda":
        parts += [nvcc_version(), cuda_architectures()]
    return parts


def cache_key(device: str) -> str:
    digest = hashlib.sha256()
    for part in key_parts(device):
        digest.update(part.encode())
    for src in sources(device) + headers(device):
        digest.update(src.name.encode())
        digest.update(src.read_bytes())
    return digest.hexdigest()[:16]


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


class _Ticker:
    """Prints a progress line while a long build runs."""

    def __init__(self, label: str, every: float = 15.0):
        self.label, self.every = label, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.start = time.monotonic()

    def _run(self):
        while not self._stop.wait(self.every):
            print(f"mm_adaptor: still {self.label} ({time.monotonic() - self.start:.0f} s)", file=sys.stderr,
                  flush=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False


def library_path(device: str) -> Path:
    """Where the cache holds (or will hold) the built library for `device` and these sources."""
    return cache_root() / f"{device}-{cache_key(device)}" / f"mm_adaptor_ops_{device}.so"


def cached_library(device: str) -> Path | None:
    """The built library for `device` if the cache already has it (no build)."""
    library = library_path(device)
    return library if library.exists() else None


def build(device: str, *, verbose: bool = False) -> BuildResult:
    """Build (if needed) and load the native library for `device` ('cpu' or 'cuda')."""
    srcs = sources(device)
    if not srcs:
        raise BuildUnavailable(f"no {device} sources under {CSRC / device}")
    key = cache_key(device)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    name = f"mm_adaptor_ops_{device}"
    build_dir = root / f"{device}-{key}"
    build_dir.mkdir(exist_ok=True)
    library = build_dir / f"{name}.so"
    start = time.monotonic()
    with open(root / f"{device}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            built_now = not library.exists()
            if built_now:
                print(f"mm_adaptor: building native {device} ops ({len(srcs)} sources; first use, "
                      f"about 20 s; cached in {build_dir})", file=sys.stderr, flush=True)
                with _Ticker(f"building native {device} ops"):
                    _compile_and_publish(device, name, srcs, build_dir, verbose)
                with open(root / "builds.log", "a") as log:
                    log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} built {device}-{key}\n")
                print(f"mm_adaptor: built native {device} ops in {time.monotonic() - start:.0f} s", file=sys.stderr,
                      flush=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        raise BuildUnavailable(f"the native {device} library {library} does not load: {exc}") from exc
    return BuildResult(device, library, built_now, time.monotonic() - start)


def one_translation_unit(srcs: list[Path], folder: Path) -> Path:
    """The CPU sources as one translation unit: each would otherwise parse the torch headers again, about 7 of its
    9 s of compile time, so one unit builds in about a third of the CPU time (file-local names must not repeat)."""
    unit = folder / "all_sources.cpp"
    unit.write_text("".join(f'#include "{src}"\n' for src in srcs))
    return unit


def _compile_and_publish(device: str, name: str, srcs: list[Path], build_dir: Path, verbose: bool) -> None:
    """Build in a private directory beside the cache entry, then rename the library into place."""
    from torch.utils.cpp_extension import load

    private = build_dir.with_name(f"{build_dir.name}.building-{os.getpid()}")
    shutil.rmtree(private, ignore_errors=True)
    private.mkdir()
    try:
        units = [one_translation_unit(srcs, private)] if device == "cpu" else srcs
        load(name=name, sources=[str(s) for s in units], build_directory=str(private), extra_cflags=cxx_flags(device),
             extra_cuda_cflags=NVCC_FLAGS if device == "cuda" else None,
             extra_include_paths=[str(CSRC / device)], is_python_module=False, verbose=verbose)
        (build_dir / "build.json").write_text(json.dumps(build_info(device), indent=1) + "\n")
        os.replace(private / f"{name}.so", build_dir / f"{name}.so")
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        raise BuildUnavailable(f"building the native {device} ops failed: {exc}") from exc
    finally:
        shutil.rmtree(private, ignore_errors=True)
