"""Device backends: one per device type, chosen automatically or by MM_ADAPTOR_DEVICE."""

from __future__ import annotations

import os

from mm_adaptor.devices.base import DeviceBackend, NoAcceleratorError  # noqa: F401

DEVICE_ENV = "MM_ADAPTOR_DEVICE"
BACKEND_NAMES = ("cuda", "npu", "cpu")

_installed: DeviceBackend | None = None


def _npu_present() -> bool:
    try:
        import torch_npu  # noqa: F401
    except Exception:
        return False
    import torch

    return hasattr(torch, "npu") and torch.npu.is_available()


def choose() -> tuple[str, str]:
    """Return (backend name, why it was chosen)."""
    import torch

    forced = os.environ.get(DEVICE_ENV, "").strip().lower()
    if forced:
        if forced not in BACKEND_NAMES:
            raise ValueError(
                f"{DEVICE_ENV}={forced!r} is not a device backend; choose one of {', '.join(BACKEND_NAMES)}"
            )
        return forced, f"forced by {DEVICE_ENV}={forced}"
    if torch.cuda.is_available():
        return "cuda", f"torch sees {torch.cuda.device_count()} CUDA device(s)"
    if _npu_present():
        return "npu", "torch_npu is installed and sees an Ascend NPU"
    return "cpu", "no CUDA device and no Ascend NPU found"


def make(name: str) -> DeviceBackend:
    if name == "cuda":
        from mm_adaptor.devices.cuda import CudaBackend

        return CudaBackend()
    if name == "npu":
        from mm_adaptor.devices.npu import NpuBackend

        return NpuBackend()
    if name == "cpu":
        from mm_adaptor.devices.cpu import CpuBackend

        return CpuBackend()
    raise ValueError(f"unknown device backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


def install(name: str | None = None) -> DeviceBackend:
    """Install the backend for this machine (idempotent)."""
    global _installed
    if _installed is not None:
        if name is None or name == _installed.name:
            return _installed
        raise RuntimeError(
            f"device backend {_installed.name!r} is already installed; uninstall it before installing {name!r}"
        )
    why = f"requested by the caller ({name})"
    automatic = False
    if name is None:
        name, why = choose()
        automatic = not os.environ.get(DEVICE_ENV, "").strip()
    backend = make(name)
    backend.reason = why
    backend.chosen_automatically = automatic
    backend.install()
    _installed = backend
    return backend


def uninstall() -> None:
    global _installed
    if _installed is not None:
        _installed.uninstall()
        _installed = None


def current() -> DeviceBackend | None:
    return _installed


def current_or_chosen() -> DeviceBackend:
    """The installed backend, else the one this machine would get (not installed)."""
    return current() or make(choose()[0])
