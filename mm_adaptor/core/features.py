"""Feature base class and registry. One module per feature lives in feature_flags/."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import pkgutil
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from mm_adaptor.versions import contracts
from mm_adaptor.core.errors import ConfigurationError
from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, PatchSet


class FeatureConfigError(ConfigurationError, ValueError):
    """A feature's options conflict with the configuration; the message names the flags and the fix."""


@dataclass(frozen=True)
class Flag:
    """One command-line flag of a feature.

    `megatron_owned` marks flags Megatron-LM already defines (e.g. --use-flash-attn): under
    Megatron-LM's parser the feature attaches to the existing flag instead of adding it again.
    """

    option: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    choices: tuple | None = None
    megatron_owned: bool = False
    # A flag whose value may be left out (nargs "?"): given alone it takes `const`.
    value_optional: bool = False
    const: Any = None

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")

    @property
    def is_switch(self) -> bool:
        return self.type is None

    def default_value(self):
        return False if self.is_switch and self.default is None else self.default

    def add_to(self, parser_or_group) -> None:
        if self.is_switch:
            parser_or_group.add_argument(self.option, action="store_true", default=self.default_value(),
                                         help=self.help)
        elif self.value_optional:
            parser_or_group.add_argument(self.option, type=self.type, default=self.default, nargs="?",
                                         const=self.const, choices=self.choices, help=self.help)
        else:
            parser_or_group.add_argument(self.option, type=self.type, default=self.default,
                                         choices=self.choices, help=self.help)


@dataclass(frozen=True)
class Tolerance:
    """How close a feature's results must be to unpatched Megatron, and why.

    exact: every loss, gradient and parameter bit-for-bit. Otherwise the harness judges each loss, gradient (every
    step) and parameter update against thresholds calibrated from Megatron's own rounding noise in the run's
    precision (mm_adaptor.harness.verdict), multiplied by `factor` (which a feature must justify in `why`)."""

    exact: bool
    why: str = ""
    factor: float = 1.0

    def describe(self) -> str:
        if self.exact:
            return f"bit-for-bit ({self.why})" if self.why else "bit-for-bit"
        scale = f" x{self.factor:g}" if self.factor != 1 else ""
        return f"calibrated rounding noise{scale} ({self.why})" if self.why else f"calibrated rounding noise{scale}"


BIT_FOR_BIT = Tolerance(exact=True, why="the math is unchanged")
# Why every feature is trusted on the suite's base release (its default verified_on).
BASE_RELEASE = "check passes in every layout the feature acts in (the suite's base release, CI's 0.16.1 leg)"


def fused_kernel_tolerance(what_differs: str) -> Tolerance:
    """The tolerance of a feature that computes the same math with different rounding."""
    return Tolerance(exact=False, why=what_differs)


def wrap_one(feature_name: str, target: str, wrapper, versions: str = SUPPORTED_MEGATRON_CORE) -> list[PatchSet]:
    """The patch sets of a feature that wraps a single megatron function."""
    from mm_adaptor.core.patching import Contract

    ps = PatchSet(feature_name)
    ps.wrap(target, wrapper, contract=Contract(versions=versions))
    return [ps]


class Feature:
    """Subclass, set the class attributes, implement `patch_sets`, and decorate with @register."""

    name: str = ""
    description: str = ""
    flags: tuple[Flag, ...] = ()
    requires: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    tolerance: Tolerance = BIT_FOR_BIT
    # True when the feature stores parameters differently (e.g. experts fused into one matrix): the harness
    # then starts both runs from one checkpoint, which megatron's sharded state dicts make interchangeable.
    changes_parameter_layout: bool = False
    # Megatron-LM arguments shown to its validate_args with these values (restored afterwards), for checks
    # that guard an implementation this feature replaces.
    megatron_lm_validation_overrides: dict[str, Any] = {}
    # Megatron switches that unpatched Megatron cannot run here and that only this feature makes work: the
    # harness's baseline runs without them (e.g. SequentialMLP instead of GroupedMLP for --moe-grouped-gemm).
    unpatched_baseline_omits: tuple[str, ...] = ()
    # Each rank holds other tokens than in the unpatched run (e.g. context parallelism against data parallelism):
    # the check judges losses, gradients and parameters, not per-rank module outputs.
    splits_sequence: bool = False
    # Each rank holds other experts (or other slices of them) than in the unpatched run (e.g. expert tensor
    # parallelism folded into expert parallelism): the check compares expert parameters and gradients whole, each
    # assembled from every rank by its global expert index (harness.expert_view.assemble_experts).
    regroups_experts: bool = False
    # The feature's facts, read by contracts, verification, report and the docs:
    # the megatron-core versions its regression checks passed on, each with the one-line reason it is trusted there
    # (a patch serves where the installed function's code is that of one of these; docs/megatron-lm.md has detail);
    verified_on: dict[str, str] = {"0.16.1": BASE_RELEASE}
    # what has run on each device, verification.Record per device name (a device left out: no run recorded);
    devices: dict = {}
    # configurations it refuses, shown with its own message on its docs page: (what the probe shows, the options).
    refusal_probes: tuple[tuple[str, dict], ...] = ()

    @property
    def main_flag(self) -> Flag:
        return self.flags[0]

    def is_enabled(self, options) -> bool:
        return bool(getattr(options, self.main_flag.dest, False))

    def validate(self, options) -> None:
        """Raise FeatureConfigError naming the flags in conflict and the fix. A feature attached to a Megatron-owned
        flag never raises for a configuration Megatron accepts: it stands aside instead (see stands_aside)."""

    def stands_aside(self, options) -> str | None:
        """Consulted only when the main flag is Megatron-owned: why this feature cannot serve the configuration
        (it is then not applied and Megatron's own meaning of the flag stays, with one warning), or None."""
        return None

    def megatron_arguments(self, options) -> dict[str, Any]:
        """Megatron's own arguments that express this feature ({} for a feature that patches code): argument name ->
        the value Megatron is given, computed from the user's values (users_value). Set once on the arguments before
        Megatron's layout is checked and built (express_in_megatron_arguments); {} where validate refuses."""
        return {}

    def patch_sets(self, options) -> list[PatchSet]:
        raise NotImplementedError

    def can_run_here(self) -> tuple[bool, str]:
        return True, "yes"

    def statistics(self) -> dict | None:
        """What the applied feature did so far (counts, bytes), for the driver's dump; None when it keeps none."""
        return None

    def options_of(self, options) -> dict[str, Any]:
        return {flag.dest: getattr(options, flag.dest, flag.default_value()) for flag in self.flags}


def refuse_unless_local_spec(feature: Feature, options, refusal: str | None) -> None:
    """validate() of a local-spec feature whose own checks come as one refusal line (or None)."""
    if refusal:
        raise FeatureConfigError(refusal)
    require_local_spec(feature, options)


def require_local_spec(feature: Feature, options) -> None:
    impl = getattr(options, "transformer_impl", "local")
    if impl != "local":
        raise FeatureConfigError(f"{feature.main_flag.option} patches megatron's local layer spec; it needs "
                                 f"--transformer-impl local (got {impl}) — Transformer Engine has its own "
                                 f"fused kernels")


# Comma-separated modules that register features of their own (plugins, or test variants).
EXTRA_FEATURES_ENV = "MM_ADAPTOR_FEATURE_MODULES"

_REGISTRY: dict[str, Feature] = {}
_discovered = False


def register(cls: type[Feature]) -> type[Feature]:
    if not cls.name or not cls.flags:
        raise TypeError(f"{cls.__name__} needs a name and at least one flag")
    if cls.name in _REGISTRY and type(_REGISTRY[cls.name]) is not cls:
        raise TypeError(f"feature {cls.name!r} is registered twice")
    taken = {f.option: feat.name for feat in _REGISTRY.values() for f in feat.flags if feat.name != cls.name}
    for flag in cls.flags:
        if flag.option in taken:
            raise TypeError(f"flag {flag.option} of {cls.name!r} already belongs to {taken[flag.option]!r}")
    _REGISTRY[cls.name] = cls()
    contracts.VERIFIED_ON[cls.name] = tuple(cls.verified_on)
    return cls


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)
    contracts.VERIFIED_ON.pop(name, None)


# Packages (or modules) of features, named by their distributions' entry points in this group: the built-in ones are
# pyproject.toml's; a plugin distribution adds its own. Each package's modules not starting with "_" are imported.
ENTRY_POINT_GROUP = "mm_adaptor.core.features"


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    names = [entry.value for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]
    if BUILT_IN_PACKAGE not in names:
        raise RuntimeError(f"mm_adaptor's features register through its package metadata (entry points "
                           f"{ENTRY_POINT_GROUP!r}), which this environment lacks: install it (pip install -e .)")
    for name in names:
        package = importlib.import_module(name)
        for info in pkgutil.iter_modules(getattr(package, "__path__", [])):
            if not info.name.startswith("_"):
                importlib.import_module(f"{package.__name__}.{info.name}")
    for module in filter(None, os.environ.get(EXTRA_FEATURES_ENV, "").split(",")):
        importlib.import_module(module.strip())


def all_features() -> list[Feature]:
    _discover()
    return list(_REGISTRY.values())


BUILT_IN_PACKAGE = "mm_adaptor.feature_flags"


def built_in_features() -> list[Feature]:
    """The product's features (feature_flags/), not the test or calibration features others register."""
    return [f for f in all_features() if type(f).__module__.startswith(BUILT_IN_PACKAGE + ".")]


def get(name: str) -> Feature:
    _discover()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no feature named {name!r}; known: {', '.join(sorted(_REGISTRY)) or 'none'}") from None


def all_flags() -> list[tuple[Feature, Flag]]:
    return [(feature, flag) for feature in all_features() for flag in feature.flags]


def add_arguments(parser: argparse.ArgumentParser, *, title: str = "mm_adaptor features") -> argparse.ArgumentParser:
    """Add every feature's flags; a flag the parser already has (Megatron-LM's own) is attached to, not re-added."""
    existing = set(parser._option_string_actions)
    group = parser.add_argument_group(title=title)
    for _feature, flag in all_flags():
        if flag.option in existing:
            continue
        flag.add_to(group)
    return parser


def fill_defaults(options) -> Any:
    """Give an options namespace every feature dest it lacks, at its default."""
    for _feature, flag in all_flags():
        if not hasattr(options, flag.dest):
            setattr(options, flag.dest, flag.default_value())
    return options


def enabled_features(options) -> list[Feature]:
    return [feature for feature in all_features() if feature.is_enabled(options)]


_stood_aside: set[tuple[str, str]] = set()


def serving(options, candidates: Iterable[Feature]) -> list[Feature]:
    """The candidates that serve this configuration: one attached to a Megatron-owned flag that cannot serve it
    stands aside, with one warning per process naming the flag and the reason."""
    kept = []
    for feature in candidates:
        reason = feature.stands_aside(options) if feature.main_flag.megatron_owned else None
        if reason is None:
            kept.append(feature)
            continue
        if (feature.name, reason) not in _stood_aside:
            _stood_aside.add((feature.name, reason))
            flag = feature.main_flag.option
            warnings.warn(f"mm_adaptor leaves {flag} to Megatron: {reason}; Megatron's own {flag} behaviour stays",
                          RuntimeWarning, stacklevel=3)
    return kept


def validate(options, features: Iterable[Feature]) -> None:
    features = list(features)
    names = {feature.name for feature in features}
    for feature in features:
        for needed in feature.requires:
            if needed not in names:
                other = get(needed)
                raise FeatureConfigError(
                    f"{feature.main_flag.option} requires {other.main_flag.option}: add {other.main_flag.option} "
                    f"or drop {feature.main_flag.option}"
                )
        for clash in feature.conflicts:
            if clash in names:
                other = get(clash)
                raise FeatureConfigError(
                    f"{feature.main_flag.option} cannot be combined with {other.main_flag.option}: "
                    f"drop one of them"
                )
        feature.validate(options)


# Where the user's values of the arguments a feature rewrote are kept (Feature.megatron_arguments).
USERS_ARGUMENTS = "mm_adaptor_users_arguments"


def users_value(options, name: str, default=None):
    """The user's value of an argument, also after a feature expressed itself in it (express_in_megatron_arguments)."""
    kept = getattr(options, USERS_ARGUMENTS, None) or {}
    return kept[name] if name in kept else getattr(options, name, default)


def express_in_megatron_arguments(options, enabled: Iterable[Feature]) -> dict[str, Any]:
    """Set on `options` the Megatron arguments the enabled features are expressed in (Feature.megatron_arguments),
    once: a second call changes nothing. Returns the user's values of what was rewritten (also kept on the options,
    where users_value reads them)."""
    kept = getattr(options, USERS_ARGUMENTS, None)
    if kept is not None:
        return kept
    rewritten: dict[str, Any] = {}
    for feature in enabled:
        for name, value in feature.megatron_arguments(options).items():
            rewritten.setdefault(name, getattr(options, name, None))
            setattr(options, name, value)
    if rewritten:
        setattr(options, USERS_ARGUMENTS, rewritten)
    return rewritten


@dataclass
class AppliedFeature:
    feature: Feature
    options: dict[str, Any]
    patch_sets: list[PatchSet] = field(default_factory=list)

    def targets(self) -> list[str]:
        return [target for ps in self.patch_sets for target in ps.targets()]
