"""Hooks into Megatron-LM's argument handling (megatron.training), installed lazily on import."""

from __future__ import annotations

import sys

import wrapt

from mm_adaptor.core import features
from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

_hooks_registered = False
_argument_patches: list[PatchSet] = []
_ABSENT = object()


def _add_feature_arguments(wrapped, instance, args, kwargs):
    parser = wrapped(*args, **kwargs)
    return features.add_arguments(parser)


def _assign(namespace, values: dict) -> None:
    for name, value in values.items():
        if value is _ABSENT:
            if hasattr(namespace, name):
                delattr(namespace, name)
        else:
            setattr(namespace, name, value)


def _validate_with_overrides(wrapped, args, kwargs, megatron_args):
    """Run Megatron-LM's validation with the enabled features' overrides in place; its argument printout and
    everything after validation see the user's values."""
    overrides = {}
    for feature in features.enabled_features(features.fill_defaults(megatron_args)):
        overrides.update(feature.megatron_lm_validation_overrides)
    if not overrides:
        return wrapped(*args, **kwargs)
    users = {name: getattr(megatron_args, name, _ABSENT) for name in overrides}

    def print_users_values(print_args, _instance, p_args, p_kwargs):
        _assign(megatron_args, users)
        try:
            return print_args(*p_args, **p_kwargs)
        finally:
            _assign(megatron_args, overrides)

    printout = PatchSet("megatron-lm:validation-printout")
    if hasattr(sys.modules[wrapped.__module__], "_print_args"):
        printout.wrap(f"{wrapped.__module__}._print_args", print_users_values)
    _assign(megatron_args, overrides)
    printout.apply()
    try:
        return wrapped(*args, **kwargs)
    finally:
        printout.revert()
        _assign(megatron_args, users)


def refuse_known_megatron_bugs(megatron_args) -> None:
    """After Megatron's validation (its defaults filled in): a layout the installed megatron-core trains wrongly."""
    from mm_adaptor.core.errors import ConfigurationError
    from mm_adaptor.versions import known_bugs

    problem = known_bugs.layout_problem(megatron_args)
    if problem:
        raise ConfigurationError(problem)


def _check_device_serves(megatron_args) -> None:
    from mm_adaptor import devices

    backend = devices.current() or devices.install()
    backend.refuse_arguments(megatron_args)
    requested = getattr(megatron_args, "distributed_backend", None)
    if requested is not None:
        default = " (Megatron-LM's default)" if requested == "nccl" else ""
        backend.check_distributed_backend(requested, asked_by=f"--distributed-backend {requested}{default}",
                                          how_to_choose_cpu="pass --distributed-backend gloo")


def _enable_after_validation(wrapped, instance, args, kwargs):
    megatron_args = args[0] if args else kwargs.get("args")
    # a feature that is Megatron's own arguments with other values (Feature.megatron_arguments, e.g.
    # --moe-tp-extend-ep): Megatron validates and builds the rewritten layout
    options = features.fill_defaults(megatron_args)
    features.express_in_megatron_arguments(options, features.serving(options, features.enabled_features(options)))
    result = _validate_with_overrides(wrapped, args, kwargs, megatron_args)
    from mm_adaptor import __version__, devices
    from mm_adaptor.api import applied_features, enable

    refuse_known_megatron_bugs(megatron_args)
    _check_device_serves(megatron_args)
    enable(megatron_args)
    if getattr(megatron_args, "rank", 0) == 0:
        backend = devices.current()
        listed = "; ".join(f"{name} ({len(targets)} patches)" for name, targets in applied_features().items())
        compat = f" ({len(backend.applied_targets())} patches)" if backend else ""
        print(f"> mm_adaptor {__version__}: device backend {backend.name if backend else '?'}{compat}; "
              f"features applied: {listed or 'none'}", flush=True)
    return result


def _arguments_patch_set() -> PatchSet:
    ps = PatchSet("megatron-lm:arguments")
    contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
    ps.wrap("megatron.training.arguments.add_megatron_arguments", _add_feature_arguments, contract=contract)
    ps.wrap("megatron.training.arguments.validate_args", _enable_after_validation, contract=contract)
    return ps


def _yaml_patch_set() -> PatchSet:
    ps = PatchSet("megatron-lm:yaml-arguments")
    ps.wrap("megatron.training.yaml_arguments.validate_yaml", _enable_after_validation,
            contract=Contract(versions=SUPPORTED_MEGATRON_CORE))
    return ps


def _on_import(factory):
    def hook(_module):
        patch_set = factory()
        patch_set.apply()
        _argument_patches.append(patch_set)

    return hook


def register_hooks() -> None:
    """Arrange for feature flags to reach Megatron-LM's parser whenever it is imported (before or after us)."""
    global _hooks_registered
    if _hooks_registered:
        return
    _hooks_registered = True
    wrapt.register_post_import_hook(_on_import(_arguments_patch_set), "megatron.training.arguments")
    wrapt.register_post_import_hook(_on_import(_yaml_patch_set), "megatron.training.yaml_arguments")
