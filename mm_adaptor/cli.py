"""`mm-adaptor` command line: report, train (and check once the harness lands)."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys


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
    lines.append("  npu                  " + ("torch_npu present" if _version("torch-npu") != "not installed"
                                              else "torch_npu not installed: NPU path not verified on hardware here"))
    lines.append("")
    ops = ops_status()
    lines.append("native ops")
    lines.append(f"  {ops['note']}")
    for op, state in ops.get("ops", {}).items():
        lines.append(f"  {op:<22} {state}")
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


def _megatron_lm_location() -> str:
    try:
        import importlib.util

        spec = importlib.util.find_spec("megatron.training")
    except Exception:
        spec = None
    return spec.origin if spec and spec.origin else "not importable (Megatron-LM is optional)"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mm-adaptor", description="Acceleration adaptor for Megatron-Core.")
    sub = parser.add_subparsers(dest="command", metavar="{report,train}")
    sub.add_parser("report", help="versions, device backend, native ops and every feature")
    sub.add_parser("train", help="train the built-in tiny GPT (see mm-adaptor train --help)", add_help=False)
    if not argv:
        parser.print_help()
        return 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from mm_adaptor.train import main as train_main

        return train_main(rest)
    args = parser.parse_args(argv)
    if args.command == "report":
        print("\n".join(report_lines()))
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
