"""Which megatron-core functions each feature patches, and whether it serves on the installed version.

`registered_megatron_patches()` builds (without applying) every patch set the project has: each feature's with its
flag on, the device backends', the compatibility fixes and Megatron-LM's argument hooks, and lists the patches
whose contract is on megatron-core. scripts/fingerprint_megatron.py fingerprints those targets in each tagged
release; `feature_version_report()` says, per feature, the versions it was verified on and its state here.
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass, field

from mm_adaptor.versions import contracts
@dataclass(frozen=True)
class RegisteredPatch:
    owner: str  # the feature or patch set's name (what VERIFIED_ON is keyed by)
    target: str
    contract: contracts.Contract


def _switched_on(feature) -> argparse.Namespace:
    """Options with the feature's main flag on (the value it takes given alone), everything else at defaults."""
    from mm_adaptor.core import features
    options = features.fill_defaults(argparse.Namespace())
    flag = feature.main_flag
    if flag.is_switch:
        value = True
    elif flag.const is not None:
        value = flag.const
    elif flag.choices:
        value = flag.choices[-1]
    else:
        value = flag.type("1")
    setattr(options, flag.dest, value)
    return options


def _device_and_hook_patch_sets(errors: list[str]) -> list:
    from mm_adaptor import megatron_lm
    from mm_adaptor.devices.cpu import CpuBackend
    from mm_adaptor.devices.npu import NpuBackend
    from mm_adaptor.devices.redirect import rng_state_patches
    from mm_adaptor.devices import megatron_compat
    from mm_adaptor.core.patching import PatchSet

    from mm_adaptor.train import engine

    sets = [*megatron_compat.every_device_patch_sets(), megatron_lm._arguments_patch_set(),
            megatron_lm._yaml_patch_set(), engine.trainer_patch_set()]
    for backend in (CpuBackend(), NpuBackend()):
        for method in (backend.device_patch_sets, backend.training_patch_sets):
            try:
                sets.extend(method())
            except Exception as error:  # the NPU's device patches need torch_npu: its megatron ones are these
                errors.append(f"{backend.name}.{method.__name__}: {type(error).__name__}: {error}")
                if method == backend.device_patch_sets and backend.name == "npu":
                    core = PatchSet("device:npu:megatron-core")
                    rng_state_patches(core, lambda: None, lambda state: None, "the NPU backend")
                    sets.append(core)
    return sets


def registered_megatron_patches(errors: list[str] | None = None) -> list[RegisteredPatch]:
    """Every patch on megatron-core the project can apply (built, not applied), sorted by target; a patch-set
    factory that cannot run here is noted in `errors`."""
    from mm_adaptor.core import features
    errors = [] if errors is None else errors
    sets = []
    for feature in features.all_features():
        try:
            sets.extend(feature.patch_sets(_switched_on(feature)))
        except Exception as error:
            errors.append(f"{feature.name}: {type(error).__name__}: {error}")
    sets.extend(_device_and_hook_patch_sets(errors))
    found = {}
    for patch_set in sets:
        for patch in patch_set:
            contract = getattr(patch, "contract", None)
            if contract is not None and contract.package == contracts.MEGATRON_CORE:
                found[(patch.feature or patch_set.name, patch.target)] = RegisteredPatch(
                    patch.feature or patch_set.name, patch.target, contract)
    return sorted(found.values(), key=lambda p: (p.target, p.owner))


@dataclass
class FeatureVersions:
    name: str
    verified: tuple[str, ...]
    targets: list[str]
    refusals: list[str] = field(default_factory=list)  # one line per changed function
    absent_modules: list[str] = field(default_factory=list)  # targets whose module is not installed here

    @property
    def state(self) -> str:
        if self.refusals:
            return "refuses: " + "; ".join(self.refusals)
        if self.absent_modules:
            return (f"not installed here ({', '.join(sorted(set(self.absent_modules)))}); checked when it is "
                    "imported")
        return "serves"


def _pin_problem(patch: RegisteredPatch) -> str | None:
    """The contract's explicit pin (`fingerprint=`) checked against the installed original, which it imports."""
    from mm_adaptor.core.patching import _MISSING, Patch, PatchError, resolve

    try:
        owner, name = resolve(patch.target)
    except PatchError as error:
        return str(error)
    original, _own = Patch._raw_attribute(owner, name)
    if original is not _MISSING and contracts.fingerprint(original) != patch.contract.fingerprint:
        return f"{patch.target}'s source differs from the one its patch pins"
    return None


def feature_states(installed: str | None = None) -> list[FeatureVersions]:
    """Per feature (or patch set), its verified versions and whether each megatron-core target it patches is
    unchanged here (the check applying it makes)."""
    from mm_adaptor.versions.source_fingerprint import installed_module

    installed = installed or contracts.installed_version() or "?"
    by_owner: dict[str, list[RegisteredPatch]] = {}
    for patch in registered_megatron_patches():
        by_owner.setdefault(patch.owner, []).append(patch)
    states = []
    for owner, patches in sorted(by_owner.items()):
        state = FeatureVersions(owner, contracts.verified_versions(owner), [p.target for p in patches])
        for patch in patches:
            module = installed_module(patch.target)
            if module is None or module.count(".") < 1:
                state.absent_modules.append(".".join(patch.target.split(".")[:2]))
                continue
            problem = contracts.megatron_problem(owner, patch.target, installed)
            if problem is None and patch.contract.fingerprint is not None:
                problem = _pin_problem(patch)
            if problem:
                state.refusals.append(problem)
        states.append(state)
    return states


def changed_targets() -> dict[str, dict[str, int | None]]:
    """target -> {version: lines of diff since the base release, 0 when its code is the same (comments and
    formatting aside), None when it is not defined there}, from the table."""
    from mm_adaptor.versions.fingerprint_table import BASE, CHANGED_LINES, FINGERPRINTS

    def lines(target: str, version: str) -> int | None:
        recorded = FINGERPRINTS[target]
        if recorded.get(version) is None:
            return None
        return 0 if recorded[version] == recorded.get(BASE) else max(1, CHANGED_LINES[target][version])

    return {target: {version: lines(target, version) for version in FINGERPRINTS[target] if version != BASE}
            for target in sorted(FINGERPRINTS)}


def refusals_here(installed: str | None = None) -> dict[str, list[str]]:
    """Each feature's refusals on the installed megatron-core (none for a feature that patches no megatron function
    here, e.g. one expressed in megatron's own arguments)."""
    return collections.defaultdict(list, {state.name: state.refusals for state in feature_states(installed)})


def feature_version_report() -> list[str]:
    """Lines for `mm-adaptor report`: each feature's verified versions and state on the installed megatron-core,
    then which patched upstream functions changed in later releases (lines of diff; '-' unchanged)."""
    from mm_adaptor.versions.fingerprint_table import BASE, VERSIONS

    installed = contracts.installed_version() or "not installed"
    lines = [f"megatron-core {installed} (installs beside {contracts.SUPPORTED_MEGATRON_CORE}); per feature, "
             "the versions it was verified on and its state here:"]
    for state in feature_states(installed):
        lines.append(f"  {state.name}: verified on {', '.join(state.verified)}; {state.state}")
    later = [v for v in VERSIONS if v != BASE]
    lines.append(f"patched upstream functions changed since {BASE} (lines of diff; '-' unchanged, 'absent' not "
                 "defined):")
    lines.append("  " + " | ".join(["target", *later]))
    for target, per_version in changed_targets().items():
        cells = ["absent" if n is None else "-" if n == 0 else str(n) for n in (per_version[v] for v in later)]
        if any(cell != "-" for cell in cells):
            lines.append("  " + " | ".join([target, *cells]))
    return lines
