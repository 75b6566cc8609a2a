"""Regression harness: the same tiny GPT trained with features off, then on, in fresh processes with the
same seeds and data; per-step losses and final gradients/parameters compared with the features' tolerance."""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mm_adaptor import features
from mm_adaptor.features import Tolerance

LAYOUTS: dict[str, list[str]] = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "pp2-vpp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                 "--global-batch-size", "8"],
    "dp2-distopt": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
    "ep2-moe": ["--num-experts", "4", "--expert-model-parallel-size", "2"],
}


class HarnessError(RuntimeError):
    pass


@dataclass
class TensorDiff:
    max_abs: float = 0.0
    worst: str = ""
    count: int = 0
    failures: list[str] = field(default_factory=list)


@dataclass
class Comparison:
    layout: str
    feature_args: list[str]
    tolerance: Tolerance
    losses_off: list[float]
    losses_on: list[float]
    grads: TensorDiff
    params: TensorDiff
    memory_off: dict
    memory_on: dict
    loss_failures: list[int] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not (self.loss_failures or self.grads.failures or self.params.failures)


def _features_switched_on(flags: list[str]) -> list[features.Feature]:
    parser = features.add_arguments(argparse.ArgumentParser(add_help=False))
    options, _ = parser.parse_known_args(flags)
    return features.enabled_features(options)


def tolerance_for(feature_args: list[str], low_precision: bool = False) -> Tolerance:
    """The loosest tolerance among the features switched on by these flags (bit-for-bit if all are)."""
    enabled = _features_switched_on(feature_args)
    if not enabled:
        raise HarnessError(f"no feature is switched on by {' '.join(feature_args) or '(no flags)'}")
    inexact = [f.tolerance.for_precision(low_precision) for f in enabled if not f.tolerance.exact]
    if not inexact:
        why = "; ".join(f"{f.main_flag.option}: {f.tolerance.why}" for f in enabled)
        return Tolerance(exact=True, why=why)
    return Tolerance(exact=False, rtol=max(t.rtol for t in inexact), atol=max(t.atol for t in inexact),
                     why="; ".join(f"{f.main_flag.option}: {f.tolerance.why}" for f in enabled if not f.tolerance.exact))


def _close(a: torch.Tensor, b: torch.Tensor, tol: Tolerance) -> bool:
    if tol.exact:
        return torch.equal(a, b)
    return a.shape == b.shape and torch.allclose(a, b, rtol=tol.rtol, atol=tol.atol)


def _compare_tensors(off: list[dict], on: list[dict], key: str, tol: Tolerance) -> TensorDiff:
    diff = TensorDiff()
    for rank, (a_rank, b_rank) in enumerate(zip(off, on)):
        a_all, b_all = a_rank[key], b_rank[key]
        if a_all.keys() != b_all.keys():
            missing = sorted(set(a_all) ^ set(b_all))
            diff.failures.append(f"rank {rank}: {key} differ in names: {missing[:5]}")
            continue
        for name, a in a_all.items():
            b = b_all[name]
            diff.count += 1
            if a.shape != b.shape:
                diff.failures.append(f"rank {rank} {name}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
                continue
            delta = float((a - b).abs().max()) if a.numel() else 0.0
            if delta > diff.max_abs:
                diff.max_abs, diff.worst = delta, f"rank {rank} {name}"
            if not _close(a, b, tol):
                diff.failures.append(f"rank {rank} {name}: max |diff| {delta:.3e}")
    return diff


def _loss_failures(off: list[float], on: list[float], tol: Tolerance) -> list[int]:
    bad = []
    for step, (a, b) in enumerate(zip(off, on), start=1):
        if not _close(torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64), tol):
            bad.append(step)
    if len(off) != len(on):
        bad.append(max(len(off), len(on)))
    return bad


def _train(argv: list[str], dump: Path, nproc: int, timeout: float, echo: bool) -> list[dict]:
    from mm_adaptor.train import main as train_main

    full = [*argv, "--nproc-per-node", str(nproc), "--dump", str(dump), "--quiet" if echo else "--silent", "--timeout", str(timeout)]
    sink = contextlib.nullcontext() if echo else contextlib.redirect_stdout(io.StringIO())
    with sink:
        code = train_main(full)
    if code != 0:
        raise HarnessError(f"training failed (exit {code}): mm-adaptor train {' '.join(full)}")
    return [torch.load(dump / f"rank{rank}.pt") for rank in range(nproc)]


def compare(feature_args: list[str], *, layout: str | None = None, extra_args: list[str] = (),
            iters: int = 5, nproc: int = 2, timeout: float = 600.0, tolerance: Tolerance | None = None,
            echo: bool = False, require_features: bool = True) -> Comparison:
    """Train with `feature_args` off and on; compare losses, gradients and parameters.

    With require_features=False (and an explicit tolerance) any training flag can be compared, e.g. a
    compatibility path the adaptor provides without a feature flag."""
    if not require_features and tolerance is None:
        raise HarnessError("comparing flags that are not features needs an explicit tolerance")
    if layout is not None and layout not in LAYOUTS:
        raise HarnessError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    switched_on = _features_switched_on(list(feature_args))
    omitted = {flag for feature in switched_on for flag in feature.unpatched_baseline_omits}
    feature_args = [*feature_args, *(a for a in extra_args if a in omitted)]
    extra_args = [a for a in extra_args if a not in omitted]
    low_precision = any(flag in extra_args for flag in ("--bf16", "--fp16"))
    tol = tolerance or tolerance_for(list(feature_args), low_precision)
    base = [*(LAYOUTS[layout] if layout else []), *extra_args, "--train-iters", str(iters)]
    with tempfile.TemporaryDirectory(prefix="mm-adaptor-check-") as tmp:
        if any(f.changes_parameter_layout for f in switched_on):
            # Different parameter layouts initialise differently: both runs start from the off run's init.
            init = Path(tmp) / "init"
            _train([*base, "--train-iters", "0", "--save", str(init)], Path(tmp) / "init-dump", nproc, timeout, echo)
            base = [*base, "--load", str(init), "--no-load-optim"]
        off = _train(base, Path(tmp) / "off", nproc, timeout, echo)
        on = _train([*base, *feature_args], Path(tmp) / "on", nproc, timeout, echo)
    if require_features and not on[0]["features"]:
        raise HarnessError(f"{' '.join(feature_args)} applied no feature in the training run")
    losses_off, losses_on = off[0]["losses"], on[0]["losses"]
    return Comparison(
        layout=layout or "custom", feature_args=list(feature_args), tolerance=tol,
        losses_off=losses_off, losses_on=losses_on,
        grads=_compare_tensors(off, on, "grads", tol), params=_compare_tensors(off, on, "params", tol),
        memory_off=off[0]["memory"], memory_on=on[0]["memory"],
        loss_failures=_loss_failures(losses_off, losses_on, tol),
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:9.3f} MiB"


def format_comparison(c: Comparison) -> str:
    lines = [f"check {' '.join(c.feature_args)} | layout {c.layout} | tolerance: {c.tolerance.describe()}",
             f"  {'step':>4}  {'loss (off)':>16}  {'loss (on)':>16}  {'diff':>10}"]
    for step, (a, b) in enumerate(zip(c.losses_off, c.losses_on), start=1):
        mark = "  <- outside tolerance" if step in c.loss_failures else ""
        lines.append(f"  {step:>4}  {a:16.9e}  {b:16.9e}  {b - a:10.2e}{mark}")
    for label, d in (("gradients", c.grads), ("parameters", c.params)):
        lines.append(f"  {label}: {d.count} tensors, max |diff| {d.max_abs:.3e}" + (f" ({d.worst})" if d.max_abs else ""))
        for failure in d.failures[:5]:
            lines.append(f"    outside tolerance: {failure}")
        if len(d.failures) > 5:
            lines.append(f"    ... and {len(d.failures) - 5} more")
    lines.append(f"  {'memory (rank 0)':<34} {'off':>13}  {'on':>13}  change")
    layers_off = c.memory_off.get("saved_bytes_per_layer") or {}
    layers_on = c.memory_on.get("saved_bytes_per_layer") or {}
    rows = [(f"saved activations, {k}", layers_off.get(k, 0), layers_on.get(k, 0))
            for k in sorted(set(layers_off) | set(layers_on), key=_layer_order)]
    rows += [("parameters", c.memory_off.get("parameter_bytes", 0), c.memory_on.get("parameter_bytes", 0)),
             ("optimizer state", c.memory_off.get("optimizer_state_bytes", 0),
              c.memory_on.get("optimizer_state_bytes", 0))]
    for label, a, b in rows:
        change = f"{(b - a) / a * 100:+.1f}%" if a else "n/a"
        lines.append(f"  {label:<34} {_mib(a)}  {_mib(b)}  {change}")
    lines.append(f"  verdict: {'PASS' if c.passed else 'FAIL'} ({c.tolerance.describe()})")
    return "\n".join(lines)


def _layer_order(label: str):
    parts = label.split()
    return (0, int(parts[1])) if len(parts) == 2 and parts[1].isdigit() else (1, 0)
