"""Megatron-LM's training engine (megatron.training) across the supported releases: whether it is importable here,
and pretrain()'s call, whose signature changed twice:
- 0.16, 0.17: pretrain(datasets_provider, model_provider, model_type, forward_step, extra_args_provider=...);
  it parses and validates the arguments itself;
- 0.18: pretrain(cfg_container, datasets_provider, model_provider, model_type, forward_step, ...) after
  parse_and_validate_args() and pretrain_cfg_container_from_args();
- 0.19: the same, with model_provider a keyword (a ModelConfig may replace it).
The megatron-core wheel ships megatron.training from 0.17; on 0.16 it comes from a Megatron-LM checkout."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import warnings


def installed_megatron_core() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def missing() -> str | None:
    """Why megatron.training cannot be imported here (one line naming the fix), or None."""
    try:
        found = importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    version = installed_megatron_core()
    series = ".".join(version.split(".")[:2]) if version != "none" else "0.16"
    return (f"the trainer runs on Megatron-LM's training engine (megatron.training), which megatron-core {version}'s "
            f"wheel does not ship (it does from 0.17): put a Megatron-LM core_v{series}.x checkout on PYTHONPATH "
            "(git clone -b core_v0.16.1 https://github.com/NVIDIA/Megatron-LM; export PYTHONPATH=$PWD/Megatron-LM), "
            "or install megatron-core 0.17 or newer (Python 3.12)")


@contextlib.contextmanager
def command_line(prog: str, argv: list[str]):
    """Megatron's parse_args reads sys.argv: the trainer's command line meanwhile."""
    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        yield
    finally:
        sys.argv = saved


def parse(argv: list[str], extra_args_provider, prog: str):
    """Megatron's own parse_args (wrapped by whoever patched it) over `argv`."""
    from megatron.training import arguments

    with command_line(prog, argv):
        return arguments.parse_args(extra_args_provider)


def pretrain(argv: list[str], prog: str, *, extra_args_provider, datasets_provider, model_provider, forward_step,
             **options) -> None:
    """megatron.training.pretrain() with these providers, whatever its release's signature."""
    from megatron.core.enums import ModelType
    from megatron.training import training

    parameters = inspect.signature(training.pretrain).parameters
    with command_line(prog, argv):
        if "cfg_container" not in parameters:  # 0.16, 0.17
            training.pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                              extra_args_provider=extra_args_provider, **options)
            return
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args

        args = parse_and_validate_args(extra_args_provider=extra_args_provider)
        with warnings.catch_warnings():  # "a ModelConfig is recommended over a model provider": ours build both
            warnings.filterwarnings("ignore", message="(?s).*recommended to use a ModelConfig", category=UserWarning)
            container = pretrain_cfg_container_from_args(args, None)
        training.pretrain(container, datasets_provider, model_type=ModelType.encoder_or_decoder,
                          forward_step_func=forward_step, model_provider=model_provider, **options)
