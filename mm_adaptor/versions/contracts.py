"""Patch contracts: what a patch was verified against, checked before it is applied.

For megatron-core a contract is per upstream function, not per version range: every target has a fingerprint
of its code in each tagged megatron-core release (mm_adaptor/versions/fingerprint_table.py, made by
scripts/fingerprint_megatron.py), and each feature records the versions it was verified on. A patch serves when
the installed target's code is that of a verified version, whatever the installed version; otherwise only the
features patching that function refuse, in one line naming it. A megatron-core outside SUPPORTED_MEGATRON_CORE
gets one warning per process, nothing more. Contracts on other packages (torch) keep the plain version check.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import os
import textwrap
import warnings
from dataclasses import dataclass

import wrapt
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from mm_adaptor.versions import fingerprint_cache
from mm_adaptor.core.errors import ConfigurationError

ALLOW_MISMATCH_ENV = "MM_ADAPTOR_ALLOW_CONTRACT_MISMATCH"
# The megatron-core releases the project installs beside (pyproject.toml's dependency says the same; a test checks).
# Outside it: one warning, then each feature by its source_fingerprint.
SUPPORTED_MEGATRON_CORE = ">=0.16.0,<0.20"
MEGATRON_CORE = "megatron-core"
# The megatron-core versions each name was verified on: its regression checks passed there. A feature declares its
# own (Feature.verified_on, entered here when it registers); the compatibility and device patch sets, which are no
# features, are listed below. A name not listed has the default. What was checked on each release:
# docs/megatron-lm.md#what-was-verified-on-each-release.
DEFAULT_VERIFIED = ("0.16.1",)
VERIFIED_ON: dict[str, tuple[str, ...]] = {
    "compat:torch-norm": ("0.16.1", "0.19.0"),
    "compat:torch-adam-distributed-checkpoint": ("0.16.1", "0.19.0"),
    "device:cpu:megatron-training": ("0.16.1", "0.18.0", "0.19.0"),
    "device:npu:megatron-training": ("0.16.1", "0.18.0", "0.19.0"),
    "compat:dataset-helpers-prebuilt": ("0.16.1", "0.19.0"),
    "trainer:megatron-training": ("0.19.0",),
}
# Targets whose contract is their parameters alone: Megatron-LM entry points the adaptor only wraps to call through
# (adding its flags, enabling features after validation, passing allow_no_cuda); their bodies change every release
# without concerning the wrapper.
SIGNATURE_ONLY = frozenset({
    "megatron.training.arguments.add_megatron_arguments",
    "megatron.training.arguments.validate_args",
    "megatron.training.yaml_arguments.validate_yaml",
    "megatron.training.initialize.initialize_megatron",
    # the trainer's wrappers call through and add around (mm_adaptor/train/engine.py)
    "megatron.training.arguments.parse_args",
    "megatron.training.training.get_model",
    "megatron.training.training.train_step",
    "megatron.training.training.num_floating_point_operations",
    "megatron.training.training.build_train_valid_test_data_iterators",
    "megatron.training.training.print_rank_last",
    "megatron.training.checkpointing.load_checkpoint",
    "megatron.training.checkpointing.save_checkpoint",
    "megatron.training.initialize._warmup_jit_function",
})


class PatchError(RuntimeError):
    pass


class PatchContractError(PatchError, ConfigurationError):
    pass


class PatchContractWarning(UserWarning):
    pass


class MegatronVersionWarning(UserWarning):
    """The installed megatron-core is outside SUPPORTED_MEGATRON_CORE (said once per process)."""


def _mismatch_allowed() -> bool:
    return os.environ.get(ALLOW_MISMATCH_ENV, "").strip().lower() in ("1", "true", "yes")


def _underlying(obj):
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    elif isinstance(obj, property) and obj.fget is not None:
        obj = obj.fget
    try:
        return inspect.unwrap(obj)
    except ValueError:
        return obj


def fingerprint(obj) -> str:
    """16 hex digits identifying the source text of obj (or its signature when no source exists): the pin of a
    contract's explicit `fingerprint` (`mm-adaptor fingerprint` prints it)."""
    target = _underlying(obj)
    if isinstance(target, wrapt.ObjectProxy):
        target = target.__wrapped__
    try:
        source = textwrap.dedent(inspect.getsource(target))
        text = "\n".join(line.rstrip() for line in source.splitlines())
    except (OSError, TypeError):
        try:
            text = "sig:" + str(inspect.signature(target))
        except (TypeError, ValueError):
            text = "repr:" + repr(target)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def installed_version(package: str = MEGATRON_CORE) -> str | None:
    return _distribution_version(package)


@functools.lru_cache(maxsize=None)  # every patch's contract asks; reading the metadata costs ~1.5 ms a time
def _distribution_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# Test variants that patch a feature's own upstream functions (deliberately broken copies for the self-tests):
# name -> the feature whose verified versions they share (verified_like).
STANDS_IN_FOR: dict[str, str] = {}


def verified_like(stand_in: str, feature: str) -> None:
    STANDS_IN_FOR[stand_in] = feature


def verified_versions(feature: str) -> tuple[str, ...]:
    return VERIFIED_ON.get(STANDS_IN_FOR.get(feature, feature), DEFAULT_VERIFIED)


def recorded_fingerprints(target: str) -> dict[str, str | None] | None:
    """version -> fingerprint of the target in that megatron-core release, None when the table lacks it."""
    from mm_adaptor.versions.fingerprint_table import FINGERPRINTS

    return FINGERPRINTS.get(target)


_live: dict[str, str | None] = {}


def live_fingerprint(target: str) -> str | None:
    """The installed target's fingerprint (from its source file, normalised as the table is); None if undefined."""
    if target not in _live:
        _live[target] = fingerprint_cache.installed_fingerprint(target, signature_only=target in SIGNATURE_ONLY)
    return _live[target]


def _same_version(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def megatron_problem(feature: str, target: str, installed: str) -> str | None:
    """Why `feature` may not patch `target` on the installed megatron-core, in a few words naming it; None if it
    may: the target's code equals its code in a version the feature was verified on."""
    verified = verified_versions(feature)
    on = " or ".join(verified)
    recorded = recorded_fingerprints(target)
    if recorded is None or not any(v in recorded for v in verified):
        if any(_same_version(installed, v) for v in verified):
            return None
        return (f"no fingerprint of {target} is recorded for megatron-core {on} to compare with {installed}'s "
                "(run scripts/fingerprint_megatron.py)")
    live = live_fingerprint(target)
    if any(v in recorded and recorded[v] == live for v in verified):
        return None
    if live is None:
        return f"{target} is not defined in megatron-core {installed} (verified on {on})"
    return f"{target} changed in megatron-core {installed} (its code differs from {on}, where it was verified)"


_warned_range: set[str] = set()


def warn_if_outside_range(installed: str | None = None) -> bool:
    """One MegatronVersionWarning per process when megatron-core is installed outside SUPPORTED_MEGATRON_CORE."""
    installed = installed if installed is not None else installed_version()
    if installed is None or SpecifierSet(SUPPORTED_MEGATRON_CORE).contains(installed, prereleases=True):
        return False
    if installed not in _warned_range:
        _warned_range.add(installed)
        warnings.warn(
            f"megatron-core {installed} is outside the versions mm_adaptor installs beside "
            f"({SUPPORTED_MEGATRON_CORE}); each feature serves where the upstream functions it patches are "
            "unchanged from a version it was verified on and refuses naming the function otherwise "
            "(`mm-adaptor report` lists them)", MegatronVersionWarning, stacklevel=2)
    return True


@dataclass(frozen=True)
class Contract:
    """What a patch of `package` was verified against. For megatron-core: the per-version fingerprints of the
    target (looked up by target) and the feature's verified versions; `versions` is the range the project
    installs beside. For other packages: `versions` must contain the installed one. `fingerprint`, if given,
    pins the original's source text (or value) exactly, on every version."""

    versions: str
    fingerprint: str | None = None
    package: str = MEGATRON_CORE

    def problems(self, original, *, feature: str, target: str) -> tuple[list[str], str | None]:
        installed = installed_version(self.package)
        problems = []
        if installed is None:
            problems.append(f"{self.package} is not installed")
        elif self.package == MEGATRON_CORE:
            warn_if_outside_range(installed)
            problem = megatron_problem(feature, target, installed)
            if problem:
                problems.append(problem)
        elif not SpecifierSet(self.versions).contains(installed, prereleases=True):
            problems.append(f"{self.package} {installed} is installed, outside the supported versions")
        if self.fingerprint is not None:
            actual = fingerprint(original)
            if actual != self.fingerprint:
                where = f"{target}: " if self.package == MEGATRON_CORE else ""
                problems.append(f"{where}the original's source changed (fingerprint {actual}, expected "
                                f"{self.fingerprint})")
        return problems, installed

    def check(self, original, *, feature: str, target: str) -> None:
        problems, installed = self.problems(original, feature=feature, target=target)
        if not problems:
            return
        if self.package == MEGATRON_CORE and installed is not None:  # each problem names the function and versions
            message = f"feature {feature or '?'!r} refuses: {'; '.join(problems)}"
        else:
            found = f"{self.package} {installed}" if installed else f"{self.package} (not installed)"
            message = (f"feature {feature or '?'!r} cannot patch {target}: {'; '.join(problems)}; installed: {found}; "
                       f"this patch supports {self.package} {self.versions}")
        if _mismatch_allowed():
            warnings.warn(f"{message}; applied anyway ({ALLOW_MISMATCH_ENV} is set)", PatchContractWarning,
                          stacklevel=4)
            return
        raise PatchContractError(f"{message}; set {ALLOW_MISMATCH_ENV}=1 to downgrade this to a warning")


warn_if_outside_range()
