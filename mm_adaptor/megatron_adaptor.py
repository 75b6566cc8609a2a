"""The one-line import for Megatron-LM scripts: `import mm_adaptor.megatron_adaptor`.

It installs the device backend, registers every feature's flags with Megatron-LM's parser, and
arranges for the enabled features to be validated and applied right after Megatron validates its
arguments. Nothing is read from sys.argv here. An uncaught configuration error of the adaptor prints
one line on rank 0 instead of a traceback from every rank.
"""

from mm_adaptor.core.imports import without_gc

with without_gc():  # torch's and megatron-core's imports (devices.install imports them)
    from mm_adaptor import devices
    from mm_adaptor.core.errors import install_excepthook
    from mm_adaptor.megatron_lm import register_hooks

    install_excepthook()
    backend = devices.install()
    register_hooks()
