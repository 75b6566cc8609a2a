"""`mm-adaptor` command line: report, train, check, calibrate, build-ops, fingerprint.

Every command's parser prints an error as one line and exits with 2; torch and megatron are imported only by the
commands that need them, so `mm-adaptor --help` and argument errors are fast."""

from __future__ import annotations

import os
import platform
import sys
import textwrap

from mm_adaptor.arguments_errors import ArgumentParser, did_you_mean


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report_lines():
    """The report, line by line; the versions come before torch is imported, so the first lines are immediate."""
    from mm_adaptor import __version__

    lines = [f"mm_adaptor {__version__}  (Python {platform.python_version()}, {platform.machine()})", ""]
    lines.append("versions")
    for name, dist in (("torch", "torch"), ("megatron-core", "megatron-core"), ("torch_npu", "torch-npu"),
                       ("wrapt", "wrapt"), ("transformer-engine", "transformer-engine")):
        lines.append(f"  {name:<20} {_version(dist)}")
    megatron_lm = _megatron_lm_location()
    lines.append(f"  {'megatron.training':<20} {megatron_lm}")
    lines.append("")
    yield from lines
    lines = []
    import torch

    from mm_adaptor import devices, features, verification
    from mm_adaptor.ops import status as ops_status

    name, why = devices.choose()
    backend = devices.make(name)
    lines.append("device backend")
    lines.append(f"  chosen               {name} ({why})")
    lines.append(f"  process groups       {backend.dist_backend}")
    lines.append(f"  torch.cuda available {torch.cuda.is_available()}")
    verified = verification.BACKENDS.get(name, verification.UNRECORDED)
    lines.append(f"  verified here        {verified.state}: {verified.evidence}")
    if name == "cpu" and not os.environ.get(devices.DEVICE_ENV, "").strip():
        lines.append("  on purpose           no: chosen because no accelerator was found, so an NCCL process group "
                     "(Megatron-LM's default --distributed-backend) is refused; --distributed-backend gloo or "
                     f"{devices.DEVICE_ENV}=cpu trains on the CPU")
    lines.append("  npu                  " + ("torch_npu present" if _version("torch-npu") != "not installed"
                                              else "torch_npu not installed: NPU path not verified on hardware here"))
    lines.append("")
    lines.extend(backend_patch_lines(backend))
    lines.append("")
    ops = ops_status()
    lines.append(f"native ops ({', '.join(ops['ops'])})")
    for device, state in ops["devices"].items():
        lines.append(f"  {device:<20} {state}")
    lines.append(f"  {'note':<20} {ops['note']}")
    lines.append(f"  {'cache':<20} {ops['cache']}")
    lines.append("")
    registered = features.all_features()
    lines.append(f"features ({len(registered)})")
    if not registered:
        lines.append("  none registered yet")
    for feature in registered:
        ok, why_not = feature.can_run_here()
        lines.append(f"  {feature.name}: {feature.description}")
        lines.append(f"    flags      {' '.join(flag.option for flag in feature.flags)}")
        lines.append(f"    tolerance  {feature.tolerance.describe()}")
        lines.append(f"    runs here  {'yes' if ok else 'no: ' + why_not}")
        for device in verification.DEVICES:
            record = verification.record(feature.name, device)
            lines.extend(_wrapped(device, f"{record.state}: {record.evidence}"))
    yield from lines


def _wrapped(label: str, text: str) -> list[str]:
    return textwrap.wrap(text, width=116, initial_indent=f"    {label:<10} ", subsequent_indent=" " * 15)


def backend_patch_lines(backend) -> list[str]:
    """One section per patch set the backend applies with no feature flag: its device patches, then the
    compatibility fixes megatron needs without Transformer Engine / Apex."""
    try:
        patch_sets = [*backend.core_patch_sets(), *backend.training_patch_sets()]
    except Exception as exc:  # e.g. MM_ADAPTOR_DEVICE=cuda without a GPU
        return [f"patches without a flag: cannot list them here: {exc}"]
    lines = [f"patches without a flag (the {backend.name} backend applies these; mm_adaptor.applied() lists them "
             f"under backend:{backend.name})"]
    for patch_set in patch_sets:
        lines.append(f"  {patch_set.name}: " + (f"not applied here: {patch_set.not_needed}" if patch_set.not_needed
                                                 else f"{len(patch_set)} patch{'es' if len(patch_set) != 1 else ''}"))
        if patch_set.needed_on:
            lines.extend(_wrapped("needed on", patch_set.needed_on))
        if patch_set.changes:
            lines.extend(_wrapped("changes", patch_set.changes))
        if patch_set.unpatched:
            lines.extend(_wrapped("unpatched", patch_set.unpatched))
        described = [f"{getattr(patch, 'mode', 'provide')} {patch.target}" for patch in patch_set]
        shown = described if len(described) <= 4 else [*described[:3], f"... and {len(described) - 3} more"]
        for index, text in enumerate(shown):
            lines.append(f"    {'patches' if index == 0 else '':<10} {text}")
    return lines


def _megatron_lm_location() -> str:
    try:
        import importlib.util

        spec = importlib.util.find_spec("megatron.training")
    except Exception:
        spec = None
    return spec.origin if spec and spec.origin else "not importable (Megatron-LM is optional)"


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
    from mm_adaptor.train import build_parser

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
                "--num-layers-per-virtual-pipeline-stage")


def _layout_flags_given(argv: list[str]) -> bool:
    return any(token.split("=", 1)[0] in LAYOUT_FLAGS for token in argv)


def _ranks_needed(train_args) -> int:
    """The fewest ranks the user's parallel sizes fit: TP x PP, and expert TP (= TP) x EP x PP."""
    import math

    tp, pp = train_args.tensor_model_parallel_size, train_args.pipeline_model_parallel_size
    return max(1, math.lcm(tp * pp, tp * train_args.expert_model_parallel_size * pp))


def _default_check_layout() -> str:
    """tp2-sp, or single where the collective library wants one device per rank and the node has one."""
    from mm_adaptor import devices

    backend = devices.current_or_chosen()
    available = backend.devices_per_node()
    if available is not None and available < 2:
        print(f"mm-adaptor check: layout single (this node has {available} {backend.name.upper()} device; tp2-sp "
              "needs 2)", flush=True)
        return "single"
    return "tp2-sp"


def _baseline_cache(enabled: bool):
    import contextlib
    import os

    from mm_adaptor.harness.baseline import CACHE_ENV

    @contextlib.contextmanager
    def switched():
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

    return switched()


def calibrate_main(argv: list[str]) -> int:
    from mm_adaptor import harness
    from mm_adaptor.harness import calibration

    parser = ArgumentParser(
        prog="mm-adaptor calibrate",
        description="Measure Megatron's own rounding noise: the unpatched tiny GPT against the same model with every "
                    "matrix product summed in two halves of its inner dimension, in each layout, precision and model; "
                    "prints the largest verdict statistics and the thresholds they imply.")
    parser.add_argument("--layout", choices=[*harness.LAYOUTS, "all"], default="all")
    parser.add_argument("--precision", choices=["fp32", "bf16", "all"], default="all")
    parser.add_argument("--model", choices=[*calibration.MODELS, "all"], default="all")
    parser.add_argument("--iters", type=int, default=4)
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.fail(f"--iters {args.iters}: must be at least 1")
    pick = lambda value, choices: list(choices) if value == "all" else [value]  # noqa: E731
    try:
        rows = calibration.calibrate(pick(args.layout, harness.LAYOUTS), pick(args.precision, calibration.PRECISIONS),
                                     pick(args.model, calibration.MODELS), iters=args.iters, progress=print)
    except harness.HarnessError as exc:
        return _print_errors(parser.prog, exc)
    print(calibration.format_calibration(rows))
    return 0


def features_all_flags():
    from mm_adaptor import features

    return features.all_flags()


def _split_feature_args(argv: list[str], feature_flags: set[str]) -> tuple[list[str], list[str]]:
    """Feature flags (with their values) go to the 'on' run only; everything else to both runs."""
    from mm_adaptor import features

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


def build_ops_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="mm-adaptor build-ops",
                            description="Build the native ops ahead of time into the shared cache.")
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    from mm_adaptor.ops import builder

    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    failed = False
    for device in devices:
        try:
            result = builder.build(device, verbose=args.verbose)
            print(f"{device}: {'built' if result.built_now else 'already built'} -> {result.library} "
                  f"({result.seconds:.1f} s)")
        except builder.BuildUnavailable as exc:
            print(f"{device}: not built: {exc}")
            failed = failed or args.device != "all"
    return 1 if failed else 0


def fingerprint_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="mm-adaptor fingerprint",
                            description="Print the contract fingerprint of each dotted target (module.attribute or "
                                        "module.Class.method), for patch authors.")
    parser.add_argument("targets", nargs="+", metavar="DOTTED.TARGET")
    args = parser.parse_args(argv)
    from mm_adaptor.patching import PatchError, fingerprint, resolve

    lines = []
    for target in args.targets:  # all resolved before anything is printed
        try:
            owner, name = resolve(target)
        except PatchError as exc:
            parser.fail(str(exc))
        except Exception as exc:  # the target's module raised while importing
            parser.fail(f"cannot resolve {target!r}: importing it raised {type(exc).__name__}: {exc}")
        if isinstance(owner, type) and name in owner.__dict__:
            original = owner.__dict__[name]
        elif hasattr(owner, name):
            original = getattr(owner, name)
        else:
            parser.fail(f"cannot resolve {target!r}: {getattr(owner, '__name__', owner)} has no attribute {name!r}")
        lines.append(f"{target} {fingerprint(original)}")
    print("\n".join(lines))
    return 0


def report_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="mm-adaptor report",
                            description="Versions, device backend, native ops and every feature (imports torch, "
                                        "which is most of its time).")
    parser.parse_args(argv)
    for line in report_lines():
        print(line, flush=True)
    return 0


def _train_main(argv: list[str]) -> int:
    from mm_adaptor.train import main as train_main

    return train_main(argv)


def _schedule_main(argv: list[str]) -> int:
    from mm_adaptor.schedule import main as schedule_main

    return schedule_main(argv)


def _convert_main(argv: list[str]) -> int:
    from mm_adaptor.convert.cli import main as convert_main

    return convert_main(argv)


def _data_main(argv: list[str]) -> int:
    from mm_adaptor.data.cli import main as data_main

    return data_main(argv)


COMMANDS = {
    "report": (report_main, "versions, device backend, native ops and every feature"),
    "train": (_train_main, "train the built-in tiny GPT (see mm-adaptor train --help)"),
    "check": (check_main, "features off vs on: losses, gradients, memory (see mm-adaptor check --help)"),
    "calibrate": (calibrate_main, "measure Megatron's rounding noise, which sets check's inexact thresholds"),
    "fingerprint": (fingerprint_main, "print the contract fingerprint of dotted targets (for patch authors)"),
    "build-ops": (build_ops_main, "build the native ops ahead of time"),
    "convert": (_convert_main, "convert checkpoints: hf-to-mcore, mcore-to-hf (see mm-adaptor convert --help)"),
    "data": (_data_main, "training data: llava-to-messages, make-shapes, check (see mm-adaptor data --help)"),
    "schedule": (_schedule_main, "simulate pipeline schedules: step time, bubble, memory, timeline picture"),
    "generate": (lambda argv: __import__("mm_adaptor.generate", fromlist=["main"]).main(argv),
                 "greedy decoding with a Qwen2.5-VL checkpoint (see mm-adaptor generate --help)"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(prog="mm-adaptor", description="Acceleration adaptor for Megatron-Core.",
                            help_hint="`mm-adaptor --help` lists the commands")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, (_run, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv:
        parser.print_help()
        return 2
    command, rest = argv[0], argv[1:]
    if command in COMMANDS:
        from mm_adaptor.launcher import Interrupted, report_interruptions
        from mm_adaptor.output import PRINTER

        report_interruptions()
        try:
            status = COMMANDS[command][0](rest)
        except Interrupted as exc:  # the ranks are stopped; one line, no traceback
            print(f"mm-adaptor {command}: {exc}", file=sys.stderr)
            return exc.exit_status
        except KeyboardInterrupt:  # Ctrl-C while no rank ran
            print(f"mm-adaptor {command}: interrupted (SIGINT)", file=sys.stderr)
            return 130
        if status < 128:  # not after the one line of an interruption
            PRINTER.close()  # the count of known-harmless warnings the ranks gave, in one line
        return status
    if command.startswith("-"):
        parser.parse_args(argv)  # --help, or a one-line error
    hint = did_you_mean(command, COMMANDS)
    parser.fail(f"unknown command {command}" + (f": {hint}" if hint else "") + parser.help_pointer())


if __name__ == "__main__":
    sys.exit(main())
