"""mm_adaptor: acceleration features for Megatron-Core, each behind its own flag.

Megatron-LM users: `import mm_adaptor.megatron_adaptor` first in the training script.
Megatron-Core users: `mm_adaptor.enable(args_or_keywords)`, `mm_adaptor.applied()` (features and the device
backend's patches; `mm_adaptor.applied_features()` for the features alone), `mm_adaptor.disable()`.
"""

from mm_adaptor._version import __version__

__all__ = ["__version__", "enable", "disable", "applied", "applied_features"]


def __getattr__(name: str):
    # The API imports torch; loading it on first use keeps `mm-adaptor --help` and argument errors fast.
    if name in ("enable", "disable", "applied", "applied_features"):
        from mm_adaptor import api

        return getattr(api, name)
    raise AttributeError(f"module 'mm_adaptor' has no attribute {name!r}")
