"""`mm-adaptor report`: versions, device backend, the patches applied without a flag, native ops and every
feature with its flags, tolerance and verified devices. The versions come before torch is imported."""

from __future__ import annotations

import os
import platform
import textwrap

from mm_adaptor.core.one_line_parser import ArgumentParser
from mm_adaptor.ranks.warning_digest import ShowEveryWarning


def report_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="mm-adaptor report",
                            description="Versions, device backend, native ops and every feature (imports torch, "
                                        "which is most of its time).")
    parser.add_argument("--verbose", action=ShowEveryWarning,
                        help="print every library warning (by default the known-harmless ones are counted in one line)")
    parser.parse_args(argv)
    for line in report_lines():
        print(line, flush=True)
    return 0


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

    from mm_adaptor import devices

    from mm_adaptor.core import features

    from mm_adaptor.core import verification
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
    for device, build in ops["builds"].items():
        lines.append(f"  {device + ' build':<20} {build}")
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
    lines.append("")
    from mm_adaptor.versions.serving import feature_version_report

    lines.append("megatron-core versions")
    lines.extend(feature_version_report())
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
