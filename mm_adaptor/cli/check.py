"""`mm-adaptor check` (features off vs on, judged against their tolerance) and `mm-adaptor calibrate` (Megatron's
own rounding noise, which sets check's inexact thresholds): the two commands built on mm_adaptor.harness."""

from __future__ import annotations

import contextlib
import math
import os
import sys

from mm_adaptor.core.one_line_parser import ArgumentParser, did_you_mean


def _print_errors(prog: str, error: object) -> int:
    """One line per problem in `error`; the exit status of a refused configuration."""
    for line in str(error).splitlines():
        if line.strip():
            print(f"{prog}: error: {' '.join(line.split())}", file=sys.stderr)
    return 2


def check_main(argv: list[str]) -> int:
    """mm-adaptor check --use-X [...] [--layout L|all] [--bf16] [model/layout flags]."""
    from mm_adaptor import harness
    from mm_adaptor.harness.compare import TRAIN_FLAGS_HINT, checked_args, ranks_for
    from mm_adaptor.harness.runner import build_parser

    parser = ArgumentParser(
        prog="mm-adaptor check", help_hint=TRAIN_FLAGS_HINT,
        description="Train the tiny GPT with the given features off and on (fresh processes, same seeds and data) "
                    "and judge per-step losses, every step's gradients and the parameters against the features' "
                    "tolerance. Any other flag is passed to mm-adaptor train for both runs.")
    parser.add_argument("--layout", default=None,
                        help=f"one of {', '.join(harness.LAYOUTS)}, or 'all' (default: the layout the parallel-size "
                             "flags give, else tp2-sp; single on a node with one GPU)")
    parser.add_argument("--iters", type=int, default=4, help="training steps per run (default 4)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="ranks per run (default: what the layout needs, 1 for single, else 2)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--show-training", action="store_true", help="print both runs' iteration lines")
    parser.add_argument("--no-baseline-cache", action="store_true",
                        help="retrain the unpatched run even if an identical one is cached")
    args, rest = parser.parse_known_args(argv)
    layout_given = args.layout is not None
    args.layout = args.layout or "tp2-sp"  # until every flag is checked; then the node's devices may say single
    if args.layout != "all" and args.layout not in harness.LAYOUTS:
        parser.fail(f"--layout {args.layout}: not a layout: choose one of {', '.join(harness.LAYOUTS)} or all"
                    + (f"; {did_you_mean(args.layout, harness.LAYOUTS)}" if did_you_mean(args.layout, harness.LAYOUTS)
                       else ""))
    for flag, value in (("--iters", args.iters), ("--nproc-per-node", args.nproc_per_node)):
        if value is not None and value < 1:
            parser.fail(f"{flag} {value}: must be at least 1")
    if not args.timeout > 0:
        parser.fail(f"--timeout {args.timeout}: must be more than 0")
    # Flags meant for the training runs: an unknown one or a bad value is refused here, with suggestions.
    train_parser = build_parser(prog="mm-adaptor check")
    train_parser.also_valid, train_parser.help_hint = parser.flags(), TRAIN_FLAGS_HINT
    train_args = train_parser.parse_args(rest)
    feature_flags = {flag.option for _, flag in features_all_flags()}
    feature_args, extra = _split_feature_args(rest, feature_flags)
    layouts = list(harness.LAYOUTS) if args.layout == "all" else [args.layout]
    own_layout = not layout_given and _layout_flags_given(rest)
    if own_layout:  # the user's parallel flags are the layout: no default one added to them
        layouts, layout_given = [None], True
        args.nproc_per_node = args.nproc_per_node or _ranks_needed(train_args)

    def problems(layouts: list[str | None], check_devices: bool) -> str | None:
        for layout in layouts:  # every layout's configuration is checked before the first one trains
            try:
                checked_args([*harness.LAYOUTS.get(layout, ()), *extra, *feature_args, "--train-iters",
                              str(args.iters), "--nproc-per-node", str(args.nproc_per_node or ranks_for(layout)),
                              "--timeout", str(args.timeout)], check_devices=check_devices)
            except harness.HarnessError as exc:
                where = f"layout {layout}: " if len(layouts) > 1 else ""
                return "\n".join(where + line for line in str(exc).splitlines())
        return None

    problem = problems(layouts, check_devices=layout_given)
    if problem is None and not layout_given:
        layouts = [_default_check_layout()]
        problem = problems(layouts, check_devices=True)
    if problem:
        return _print_errors(parser.prog, problem)
    failed = []
    with _baseline_cache(not args.no_baseline_cache):
        for layout in layouts:
            try:
                result = harness.compare(feature_args, layout=layout, extra_args=extra, iters=args.iters,
                                         nproc=args.nproc_per_node, timeout=args.timeout, echo=args.show_training)
            except harness.HarnessError as exc:
                return _print_errors(parser.prog, exc)
            print(harness.format_comparison(result), flush=True)
            if not result.passed:
                failed.append(layout)
    if len(layouts) > 1:
        print(f"summary: {len(layouts) - len(failed)}/{len(layouts)} layouts within tolerance"
              + (f"; outside: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


# Flags that set a parallel size: given without --layout, they are the layout.
LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size",
                "--context-parallel-size", "--num-layers-per-virtual-pipeline-stage")


def _layout_flags_given(argv: list[str]) -> bool:
    return any(token.split("=", 1)[0] in LAYOUT_FLAGS for token in argv)


def _ranks_needed(train_args) -> int:
    """The fewest ranks the user's parallel sizes fit: TP x CP x PP, and expert TP (= TP) x EP x PP."""
    tp, pp = train_args.tensor_model_parallel_size, train_args.pipeline_model_parallel_size
    cp = getattr(train_args, "context_parallel_size", 1) or 1
    return max(1, math.lcm(tp * cp * pp, tp * train_args.expert_model_parallel_size * pp))


def _default_check_layout(quiet: bool = False) -> str:
    """tp2-sp, or single where the collective library wants one device per rank and the node has one."""
    from mm_adaptor import devices

    backend = devices.current_or_chosen()
    available = backend.devices_per_node()
    if available is not None and available < 2:
        if not quiet:
            print(f"mm-adaptor check: layout single (this node has {available} {backend.name.upper()} device; "
                  "tp2-sp needs 2)", flush=True)
        return "single"
    return "tp2-sp"


@contextlib.contextmanager
def _baseline_cache(enabled: bool):
    """Within: the harness retrains the unpatched run instead of reading the cache, unless `enabled`."""
    from mm_adaptor.harness.baseline import CACHE_ENV

    before = os.environ.get(CACHE_ENV)
    if not enabled:
        os.environ[CACHE_ENV] = "off"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = before


def calibrate_main(argv: list[str]) -> int:
    from mm_adaptor import harness
    from mm_adaptor.harness import calibration, device_calibration

    parser = ArgumentParser(
        prog="mm-adaptor calibrate",
        description="Measure Megatron's own rounding noise on this device: the unpatched tiny GPT against the same "
                    "model with every matrix product summed in halves and in thirds of its inner dimension, in each "
                    "layout, precision and model; prints the largest verdict statistics and how close a further "
                    "perturbation (fifths) comes to the limits they set, and stores that per device type, layout and "
                    "precision for `mm-adaptor check`.")
    parser.add_argument("--layout", choices=[*harness.LAYOUTS, "all"], default=None,
                        help="default: all (single on a node with one GPU)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "all"], default="all")
    parser.add_argument("--model", choices=[*calibration.MODELS, "all"], default="all")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--store-dir", default=None,
                        help=f"where the device's calibration file goes (default: ${device_calibration.DIR_ENV} or "
                             "~/.cache/mm_adaptor/calibrations)")
    parser.add_argument("--no-store", action="store_true", help="print the calibration without storing it")
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.fail(f"--iters {args.iters}: must be at least 1")
    if args.layout is None:
        args.layout = "all" if _default_check_layout(quiet=True) != "single" else "single"
    pick = lambda value, choices: list(choices) if value == "all" else [value]  # noqa: E731
    try:
        rows = calibration.calibrate(pick(args.layout, harness.LAYOUTS), pick(args.precision, calibration.PRECISIONS),
                                     pick(args.model, calibration.MODELS), iters=args.iters, progress=print)
    except harness.HarnessError as exc:
        return _print_errors(parser.prog, exc)
    print(calibration.format_calibration(rows))
    if not args.no_store:
        from pathlib import Path

        device, versions = calibration.device_and_versions()
        path = device_calibration.store(device, rows, directory=Path(args.store_dir) if args.store_dir else None,
                                        versions=versions)
        print(f"stored for {device} in {path}")
    return 0


def features_all_flags():
    from mm_adaptor.core import features
    return features.all_flags()


def _split_feature_args(argv: list[str], feature_flags: set[str]) -> tuple[list[str], list[str]]:
    """Feature flags (with their values) go to the 'on' run only; everything else to both runs."""
    from mm_adaptor.core import features
    takes_value = {flag.option for _, flag in features.all_flags() if not flag.is_switch}
    value_optional = {flag.option for _, flag in features.all_flags() if flag.value_optional}
    feature_args, extra = [], []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name in feature_flags:
            feature_args.append(token)
            if name in takes_value and "=" not in token and i + 1 < len(argv) and not (
                    name in value_optional and argv[i + 1].startswith("-")):
                feature_args.append(argv[i + 1])
                i += 1
        else:
            extra.append(token)
        i += 1
    return feature_args, extra
