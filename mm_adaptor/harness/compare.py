"""Features off vs on: the same tiny GPT trained in fresh ranks with the same seeds and data, judged by verdict.py."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mm_adaptor.core import features
from mm_adaptor.core.features import Tolerance
from mm_adaptor.harness import device_calibration, verdict
from mm_adaptor.harness.verdict import GroupVerdict, Limits

# Tiny models (2 layers; the interleaved schedule needs 2 per stage) keep a comparison to seconds.
LAYOUTS: dict[str, list[str]] = {
    "tp2": ["--num-layers", "2", "--tensor-model-parallel-size", "2"],
    "tp2-sp": ["--num-layers", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--num-layers", "2", "--pipeline-model-parallel-size", "2"],
    "pp2-vpp2": ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                 "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8"],
    "dp2-distopt": ["--num-layers", "2", "--use-distributed-optimizer", "--overlap-grad-reduce"],
    "ep2-moe": ["--num-layers", "2", "--num-experts", "4", "--expert-model-parallel-size", "2"],
    "single": ["--num-layers", "2"],
}
# Ranks each layout runs; "single" is for a machine with one GPU (two ranks cannot share one under NCCL).
LAYOUT_RANKS = {"single": 1}


def ranks_for(layout: str | None) -> int:
    return LAYOUT_RANKS.get(layout, 2)


class HarnessError(RuntimeError):
    pass


@dataclass
class Comparison:
    layout: str
    precision: str
    feature_args: list[str]
    tolerance: Tolerance
    limits: Limits
    losses_off: list[float]
    losses_on: list[float]
    verdicts: dict[str, GroupVerdict]
    memory_off: dict = field(default_factory=dict)
    memory_on: dict = field(default_factory=dict)
    noise_draws: tuple[str, ...] = ()
    calibration: str = ""

    @property
    def passed(self) -> bool:
        return not any(v.failures for v in self.verdicts.values())

    @property
    def loss_failures(self) -> list[str]:
        return self.verdicts["loss"].failures

    @property
    def activations(self) -> GroupVerdict:
        return self.verdicts["activations"]

    @property
    def grads(self) -> GroupVerdict:
        return self.verdicts["gradients"]

    @property
    def params(self) -> GroupVerdict:
        return self.verdicts["parameters"]


def _features_switched_on(flags: list[str]) -> list[features.Feature]:
    parser = features.add_arguments(argparse.ArgumentParser(add_help=False))
    options, _ = parser.parse_known_args(flags)
    return features.enabled_features(options)


def tolerance_for(feature_args: list[str]) -> Tolerance:
    """The loosest tolerance among the features switched on by these flags (bit-for-bit if all are)."""
    enabled = _features_switched_on(feature_args)
    if not enabled:
        raise HarnessError(f"no feature is switched on by {' '.join(feature_args) or '(no flags)'}")
    inexact = [f for f in enabled if not f.tolerance.exact]
    why = "; ".join(f"{f.main_flag.option}: {f.tolerance.why}" for f in (inexact or enabled))
    if not inexact:
        return Tolerance(exact=True, why=why)
    return Tolerance(exact=False, why=why, factor=max(f.tolerance.factor for f in inexact))


TRAIN_FLAGS_HINT = "`mm-adaptor check --help` and `mm-adaptor train --help` list every flag"


def _parse(argv: list[str]) -> argparse.Namespace:
    """The training arguments of one run; a bad flag or value raises HarnessError (one line, with suggestions)."""
    from mm_adaptor.harness.runner import build_parser

    parser = build_parser(prog="mm-adaptor check")
    parser.exit_on_error, parser.help_hint = False, TRAIN_FLAGS_HINT
    try:
        return parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise HarnessError(str(exc)) from None


def _checked(args: argparse.Namespace, check_devices: bool = True) -> argparse.Namespace:
    """Every rule of the driver and of the switched-on features; HarnessError has one line per problem."""
    from mm_adaptor.harness.runner import LayoutError, check_args

    try:
        check_args(args, args.nproc_per_node, check_devices=check_devices)
    except (LayoutError, features.FeatureConfigError) as exc:
        raise HarnessError(str(exc)) from None
    return args


def checked_args(argv: list[str], *, check_devices: bool = True) -> argparse.Namespace:
    """Parse and validate one run's training arguments without training (HarnessError if they cannot run)."""
    return _checked(_parse(argv), check_devices)


def _run(run, args, echo):
    from mm_adaptor.ranks.launcher import Interrupted, LaunchError

    try:
        return run(args, echo=echo)
    except Interrupted:
        raise
    except LaunchError as exc:
        raise HarnessError(f"training failed: {exc}") from None


def compare(feature_args: list[str], *, layout: str | None = None, extra_args: list[str] = (),
            iters: int = 4, nproc: int | None = None, timeout: float = 600.0, tolerance: Tolerance | None = None,
            echo: bool = False, require_features: bool = True, device_calibrated: bool = True) -> Comparison:
    """Train with `feature_args` off and on; judge losses, every step's gradients and the parameters.

    With require_features=False (and an explicit tolerance) any training flag can be compared, e.g. a
    compatibility path the adaptor provides without a feature flag. Both configurations are checked before anything
    trains; the unpatched run comes from the baseline cache when an identical one exists (a device repeat never
    does). With device_calibrated=False the limits ignore the device's stored calibration (`mm-adaptor calibrate`
    measures against the base limits)."""
    from mm_adaptor.harness import runner as train
    from mm_adaptor.harness import baseline

    if not require_features and tolerance is None:
        raise HarnessError("comparing flags that are not features needs an explicit tolerance")
    if layout is not None and layout not in LAYOUTS:
        raise HarnessError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    switched_on = _features_switched_on(list(feature_args))
    omitted = {flag for feature in switched_on for flag in feature.unpatched_baseline_omits}
    feature_args = [*feature_args, *(a for a in extra_args if a in omitted)]
    extra_args = [a for a in extra_args if a not in omitted]
    tol = tolerance or tolerance_for(list(feature_args))
    nproc = nproc or ranks_for(layout)
    base = [*(LAYOUTS[layout] if layout else []), *extra_args, "--train-iters", str(iters),
            "--nproc-per-node", str(nproc), "--timeout", str(timeout)]
    off_args, on_args = _checked(_parse(base)), _checked(_parse([*base, *feature_args]))
    if "--global-batch-size" not in base and _finalized(off_args).data_parallel_size != \
            _finalized(on_args).data_parallel_size:
        # e.g. --context-parallel-size 2 on two ranks against DP2: the default global batch follows the
        # data-parallel size, so the unpatched run is given the feature run's
        base += ["--global-batch-size", str(_finalized(on_args).global_batch_size)]
        off_args, on_args = _checked(_parse(base)), _checked(_parse([*base, *feature_args]))
    with tempfile.TemporaryDirectory(prefix="mm-adaptor-check-") as tmp:
        if any(f.changes_parameter_layout for f in switched_on):
            # Different parameter layouts initialise differently: both runs start from the off run's init.
            init = _run(lambda a, echo: baseline.initial_checkpoint(a, Path(tmp), echo=echo), off_args, echo)
            for args in (off_args, on_args):
                args.load, args.no_load_optim = str(init), True
        off = _run(baseline.cached_run, off_args, echo)
        draws = () if tol.exact else noise_draws()
        noise = None if tol.exact else [
            *(_run(lambda a, echo, parts=parts: rounding_noise_run(a, echo=echo, parts=parts), off_args, echo)
              for parts in NOISE_PARTS),
            *(_run(train.run, off_args, echo) for _ in draws[len(NOISE_PARTS):])]
        on = _run(train.run, on_args, echo)
    if require_features and not on.features:
        raise HarnessError(f"{' '.join(feature_args)} applied no feature in the training run")
    precision = verdict.precision_of(vars(on_args))
    whole = any(f.regroups_experts for f in switched_on) and verdict.expert_layouts_differ(off, on)
    limits = verdict.limits_for(tol, precision, noise and verdict.noise_table(off, *noise, whole_experts=whole))
    calibration = "" if tol.exact else device_calibration.apply(limits, layout, device_calibrated)
    return Comparison(
        layout=layout or _described_layout(on_args), precision=precision, feature_args=list(feature_args),
        tolerance=tol, limits=limits, losses_off=off.losses, losses_on=on.losses,
        verdicts=verdict.judge(off, on, limits, skip=_not_comparable(switched_on, on_args), whole_experts=whole),
        memory_off=off.memory, memory_on=on.memory, noise_draws=draws, calibration=calibration,
    )


def _not_comparable(switched_on, on_args) -> tuple[str, ...]:
    """Where a feature hands each rank other tokens than the unpatched run does (context parallelism against data
    parallelism): the module outputs differ by construction, and so do the gradient shards a rank of the distributed
    optimizer does not own (each holds its own tokens' partial sums there). Losses and parameters still judge it."""
    regrouped = any(f.regroups_experts for f in switched_on) and on_args.use_distributed_optimizer
    if not any(f.splits_sequence for f in switched_on):
        # experts regrouped under the distributed optimizer: the expert gradient buffers are sharded over other
        # boundaries, so the shards a rank does not own hold other partial sums
        return ("gradients",) if regrouped else ()
    return ("activations", "gradients") if on_args.use_distributed_optimizer else ("activations",)


def _finalized(args: argparse.Namespace) -> argparse.Namespace:
    from mm_adaptor.harness.runner import finalize_args

    return finalize_args(argparse.Namespace(**vars(args)), args.nproc_per_node)


def _described_layout(args: argparse.Namespace) -> str:
    """A layout given by parallel-size flags, in the driver's words (TP1+PP2+DP1), without the precision."""
    from mm_adaptor.harness.runner.logs import describe_layout

    return describe_layout(_finalized(args)).rsplit("+", 1)[0] + " (from the flags)"


# The noise references: every matrix product summed in halves and in thirds, the largest of the two draws counting
# at every step (verdict.noise_table). From step 2 on, the differences are dominated by the few parameters whose
# gradient is below Adam's eps, where an update moves by lr * (rounding change of that gradient) / eps: one
# perturbation's draw there can be zero (pp2-vpp2 RMSNorm fp32: the halves left position embedding [33, 23],
# gradient 1.6e-9, exactly unchanged, while any other rounding change moved its update by 2 to 20% of lr). At step 1
# one draw can sit low at one kind: on an H100 the fused rotary kernel's step-1 linear_qkv.bias gradient was 1.03x
# the limit the halves alone set.
NOISE_PARTS = (2, 3)


def noise_draws() -> tuple[str, ...]:
    """The noise references, named: the perturbations, then an unperturbed repeat of the unpatched run where the
    device is not bitwise reproducible from run to run (split-key atomics, algorithm choice); none on the CPU."""
    from mm_adaptor import devices

    backend = devices.current_or_chosen()
    repeat = () if backend.bitwise_reproducible else (f"an unperturbed repeat ({backend.name} is not bitwise "
                                                      "reproducible)",)
    return (*(f"matrix products in {PART_NAMES.get(parts, f'{parts} parts')}" for parts in NOISE_PARTS), *repeat)


PART_NAMES = {2: "halves", 3: "thirds", 5: "fifths"}


def rounding_noise_run(off_args: argparse.Namespace, *, echo: bool = False, parts: int = 2):
    """The unpatched configuration with the calibration perturbation in `parts` (cached like the baseline)."""
    from mm_adaptor.harness import baseline, split_k

    with extra_feature_module(split_k.MODULE):
        args = argparse.Namespace(**vars(off_args))
        setattr(args, split_k.SplitKPerturbation.flags[0].dest, True)
        if parts != 2:  # the default stays out of the arguments, so cached halves runs stay valid
            setattr(args, split_k.SplitKPerturbation.flags[1].dest, parts)
        return baseline.cached_run(args, echo=echo)


@contextlib.contextmanager
def extra_feature_module(module: str):
    """Register the features of `module` here and in the training ranks (MM_ADAPTOR_FEATURE_MODULES) meanwhile."""
    import importlib
    import os

    before = os.environ.get(features.EXTRA_FEATURES_ENV)
    os.environ[features.EXTRA_FEATURES_ENV] = ",".join(filter(None, [before, module]))
    registered_before = {f.name for f in features.all_features()}
    loaded = importlib.import_module(module)
    if not any(type(f).__module__ == module for f in features.all_features()):  # unregistered since its import
        importlib.reload(loaded)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(features.EXTRA_FEATURES_ENV, None)
        else:
            os.environ[features.EXTRA_FEATURES_ENV] = before
        for feature in features.all_features():
            if feature.name not in registered_before:
                features.unregister(feature.name)
