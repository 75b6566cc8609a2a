"""mm_adaptor: acceleration features for Megatron-Core, each behind its own flag.

Megatron-LM users: `import mm_adaptor.megatron_adaptor` first in the training script.
Megatron-Core users: `mm_adaptor.enable(args_or_keywords)`, `mm_adaptor.applied()` (features and the device
backend's patches; `mm_adaptor.applied_features()` for the features alone), `mm_adaptor.disable()`.
"""

from mm_adaptor._version import __version__
from mm_adaptor.api import applied, applied_features, disable, enable

__all__ = ["__version__", "enable", "disable", "applied", "applied_features"]
