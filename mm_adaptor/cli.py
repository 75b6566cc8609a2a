"""`mm-adaptor` command line: report, train (and check once the harness lands)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import textwrap


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report_lines() -> list[str]:
    import torch

    from mm_adaptor import __version__, devices, features
    from mm_adaptor.ops import status as ops_status

    lines = [f"mm_adaptor {__version__}  (Python {platform.python_version()}, {platform.machine()})", ""]
    lines.append("versions")
    for name, dist in (("torch", "torch"), ("megatron-core", "megatron-core"), ("torch_npu", "torch-npu"),
                       ("wrapt", "wrapt"), ("transformer-engine", "transformer-engine")):
        lines.append(f"  {name:<20} {_version(dist)}")
    megatron_lm = _megatron_lm_location()
    lines.append(f"  {'megatron.training':<20} {megatron_lm}")
    lines.append("")
    name, why = devices.choose()
    backend = devices.make(name)
    lines.append("device backend")
    lines.append(f"  chosen               {name} ({why})")
    lines.append(f"  process groups       {backend.dist_backend}")
    lines.append(f"  torch.cuda available {torch.cuda.is_available()}")
    if not backend.verified_on_hardware:
        lines.append("  note                 this backend's code path has not been verified on hardware")
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
    return lines


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


def check_main(argv: list[str]) -> int:
    """mm-adaptor check --use-X [...] [--layout L|all] [--bf16] [model/layout flags]."""
    from mm_adaptor import harness

    parser = argparse.ArgumentParser(
        prog="mm-adaptor check", allow_abbrev=False,
        description="Train the tiny GPT with the given features off and on (fresh processes, same seeds and data) "
                    "and judge per-step losses, every step's gradients and the parameters against the features' "
                    "tolerance. Any other flag is passed to mm-adaptor train for both runs.")
    parser.add_argument("--layout", default="tp2-sp",
                        help=f"one of {', '.join(harness.LAYOUTS)}, or 'all' (default tp2-sp)")
    parser.add_argument("--iters", type=int, default=4, help="training steps per run (default 4)")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--show-training", action="store_true", help="print both runs' iteration lines")
    parser.add_argument("--no-baseline-cache", action="store_true",
                        help="retrain the unpatched run even if an identical one is cached")
    args, rest = parser.parse_known_args(argv)
    feature_flags = {flag.option for _, flag in features_all_flags()}
    feature_args, extra = _split_feature_args(rest, feature_flags)
    layouts = list(harness.LAYOUTS) if args.layout == "all" else [args.layout]
    failed = []
    with _baseline_cache(not args.no_baseline_cache):
        for layout in layouts:
            try:
                result = harness.compare(feature_args, layout=layout, extra_args=extra, iters=args.iters,
                                         nproc=args.nproc_per_node, timeout=args.timeout, echo=args.show_training)
            except harness.HarnessError as exc:
                print(f"mm-adaptor check: {exc}", file=sys.stderr)
                return 2
            print(harness.format_comparison(result), flush=True)
            if not result.passed:
                failed.append(layout)
    if len(layouts) > 1:
        print(f"summary: {len(layouts) - len(failed)}/{len(layouts)} layouts within tolerance"
              + (f"; outside: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


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

    parser = argparse.ArgumentParser(
        prog="mm-adaptor calibrate", allow_abbrev=False,
        description="Measure Megatron's own rounding noise: the unpatched tiny GPT against the same model with every "
                    "matrix product summed in two halves of its inner dimension, in each layout, precision and model; "
                    "prints the largest verdict statistics and the thresholds they imply.")
    parser.add_argument("--layout", default="all", help=f"one of {', '.join(harness.LAYOUTS)}, or 'all' (default)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "all"], default="all")
    parser.add_argument("--model", choices=[*calibration.MODELS, "all"], default="all")
    parser.add_argument("--iters", type=int, default=4)
    args = parser.parse_args(argv)
    pick = lambda value, choices: list(choices) if value == "all" else [value]  # noqa: E731
    try:
        rows = calibration.calibrate(pick(args.layout, harness.LAYOUTS), pick(args.precision, calibration.PRECISIONS),
                                     pick(args.model, calibration.MODELS), iters=args.iters, progress=print)
    except harness.HarnessError as exc:
        print(f"mm-adaptor calibrate: {exc}", file=sys.stderr)
        return 2
    print(calibration.format_calibration(rows))
    return 0


def features_all_flags():
    from mm_adaptor import features

    return features.all_flags()


def _split_feature_args(argv: list[str], feature_flags: set[str]) -> tuple[list[str], list[str]]:
    """Feature flags (with their values) go to the 'on' run only; everything else to both runs."""
    from mm_adaptor import features

    takes_value = {flag.option for _, flag in features.all_flags() if not flag.is_switch}
    feature_args, extra = [], []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name in feature_flags:
            feature_args.append(token)
            if name in takes_value and "=" not in token and i + 1 < len(argv):
                feature_args.append(argv[i + 1])
                i += 1
        else:
            extra.append(token)
        i += 1
    return feature_args, extra


def build_ops_main(argv: list[str]) -> int:
    from mm_adaptor.ops import builder

    parser = argparse.ArgumentParser(prog="mm-adaptor build-ops",
                                     description="Build the native ops ahead of time into the shared cache.")
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
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
    from mm_adaptor.patching import fingerprint, resolve

    if not argv:
        print("usage: mm-adaptor fingerprint DOTTED.TARGET [...]", file=sys.stderr)
        return 2
    for target in argv:
        owner, name = resolve(target)
        original = owner.__dict__[name] if isinstance(owner, type) and name in owner.__dict__ else getattr(owner, name)
        print(f"{target} {fingerprint(original)}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mm-adaptor", description="Acceleration adaptor for Megatron-Core.")
    sub = parser.add_subparsers(dest="command", metavar="{report,train,check,calibrate,build-ops,fingerprint}")
    sub.add_parser("report", help="versions, device backend, native ops and every feature")
    sub.add_parser("train", help="train the built-in tiny GPT (see mm-adaptor train --help)", add_help=False)
    sub.add_parser("check", help="features off vs on: losses, gradients, memory (see mm-adaptor check --help)",
                   add_help=False)
    sub.add_parser("calibrate", help="measure Megatron's rounding noise, which sets check's inexact thresholds",
                   add_help=False)
    sub.add_parser("fingerprint", help="print the contract fingerprint of dotted targets (for patch authors)",
                   add_help=False)
    sub.add_parser("build-ops", help="build the native ops ahead of time", add_help=False)
    if not argv:
        parser.print_help()
        return 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from mm_adaptor.train import main as train_main

        return train_main(rest)
    if command == "check":
        return check_main(rest)
    if command == "calibrate":
        return calibrate_main(rest)
    if command == "fingerprint":
        return fingerprint_main(rest)
    if command == "build-ops":
        return build_ops_main(rest)
    args = parser.parse_args(argv)
    if args.command == "report":
        print("\n".join(report_lines()))
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
