"""Calibration of the inexact verdict: how far does unpatched Megatron move when only its rounding changes?

The perturbation sums every matrix product in parts along its inner dimension (two halves by default:
x[:, :k/2] @ w[:k/2] + x[:, k/2:] @ w[k/2:]): the same math in a different reduction order, with one more rounding
of each output element in the working dtype. It covers the forward of every linear layer and attention product and
the backward GEMMs of megatron's linear layers. The harness runs it once per configuration (cached) as that
configuration's noise reference; `mm-adaptor calibrate` also judges a second perturbation (thirds) against the first,
which must pass: a legitimate change of rounding is not a failure.

Importing this module registers the perturbation as a feature (`--calibration-split-k`), which is how the
training ranks get it (MM_ADAPTOR_FEATURE_MODULES); it is never registered otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from mm_adaptor.features import Feature, Flag, Tolerance, register
from mm_adaptor.patching import PatchSet

FLAG = "--calibration-split-k"
PARTS_FLAG = "--calibration-split-k-parts"
MODULE = __name__


def _split_k(matmul, parts):
    def split(a, b, *args, **kwargs):
        if args or kwargs or a.dim() < 2 or b.dim() < 2 or a.shape[-1] < 2:
            return matmul(a, b, *args, **kwargs)
        cut = max(1, a.shape[-1] // parts)
        return matmul(a[..., :cut], b[..., :cut, :]) + matmul(a[..., cut:], b[..., cut:, :])

    return split


def _split_k_baddbmm(baddbmm, bmm, parts):
    split_bmm = _split_k(bmm, parts)

    def split(input, batch1, batch2, *, beta=1, alpha=1, out=None):
        if out is not None:
            return baddbmm(input, batch1, batch2, beta=beta, alpha=alpha, out=out)
        product = split_bmm(batch1, batch2)
        if alpha != 1:
            product = product * alpha
        return product if beta == 0 else input * beta + product

    return split


def _split_k_linear(matmul, parts):
    split_matmul = _split_k(matmul, parts)

    def split(input, weight, bias=None):
        out = split_matmul(input, weight.t())
        return out if bias is None else out + bias

    return split


def perturbation_patches(parts: int = 2) -> PatchSet:
    import torch

    ps = PatchSet("calibration-split-k")
    matmul, bmm = torch.matmul, torch.bmm
    ps.replace("torch.matmul", _split_k(matmul, parts))
    ps.replace("torch.Tensor.matmul", _split_k(torch.Tensor.matmul, parts))
    ps.replace("torch.Tensor.__matmul__", _split_k(torch.Tensor.__matmul__, parts))
    ps.replace("torch.bmm", _split_k(bmm, parts))
    ps.replace("torch.baddbmm", _split_k_baddbmm(torch.baddbmm, bmm, parts))
    ps.replace("torch.nn.functional.linear", _split_k_linear(matmul, parts))
    return ps


@register
class SplitKPerturbation(Feature):
    name = "calibration-split-k"
    description = ("harness calibration only: every matrix product summed in parts along its inner dimension "
                   "(the same math, Megatron's own rounding noise)")
    flags = (Flag(FLAG, description),
             Flag(PARTS_FLAG, "the first part is 1/N of the inner dimension (default 2)", type=int, default=2))
    tolerance = Tolerance(exact=False, why="a different rounding of the same math")

    def patch_sets(self, options):
        return [perturbation_patches(getattr(options, "calibration_split_k_parts", 2))]


MODELS = {"gpt": [], "llama": ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope"]}
PRECISIONS = {"fp32": [], "bf16": ["--bf16"]}


@dataclass
class NoiseRow:
    layout: str
    precision: str
    model: str
    noise: dict  # group -> statistic -> largest noise
    second: dict  # group -> worst ratio of the thirds perturbation to the limits


def calibrate(layouts, precisions, models, *, iters: int = 4, progress=None) -> list[NoiseRow]:
    """Per configuration: the noise reference's largest statistics, and a second rounding perturbation judged by the
    harness against limits derived from the first (it must pass)."""
    from mm_adaptor import harness

    rows = []
    with harness.extra_feature_module(MODULE):
        for layout in layouts:
            for precision in precisions:
                for model in models:
                    c = harness.compare([FLAG, PARTS_FLAG, "3"], layout=layout,
                                        extra_args=[*MODELS[model], *PRECISIONS[precision]], iters=iters)
                    noise: dict = {}
                    for (group, _kind, _step), stats in c.limits.noise.items():
                        largest = noise.setdefault(group, {})
                        for stat, value in stats.items():
                            largest[stat] = max(largest.get(stat, 0.0), value)
                    rows.append(NoiseRow(layout, precision, model, noise,
                                         {group: v.worst.ratio for group, v in c.verdicts.items()}))
                    if progress:
                        progress(_format_row(rows[-1]))
    return rows


_COLUMNS = [("loss", "loss"), *((g, s) for g in ("activations", "gradients", "parameters")
                                 for s in ("rel_norm", "scale", "rel_max"))]


def _format_row(row: NoiseRow) -> str:
    noise = "".join(f"{row.noise.get(g, {}).get(s, 0.0):9.1e}" for g, s in _COLUMNS)
    second = max(row.second.values(), default=0.0)
    return f"  {row.layout:<12} {row.precision:<5} {row.model:<6}{noise}   {second:5.2f}"


def format_calibration(rows: list[NoiseRow]) -> str:
    short = {"activations": "act", "gradients": "grad", "parameters": "param", "loss": ""}
    header = "  layout       prec  model " + "".join(
        f"{(short[g] + '.' if short[g] else '') + s.replace('rel_', ''):>9}" for g, s in _COLUMNS) + "  2nd/limit"
    lines = ["Largest rounding noise per configuration (unpatched vs every matrix product split in halves), and the "
             "worst ratio of a second perturbation (thirds) to the harness's limits (must be below 1):", header]
    lines += [_format_row(row) for row in rows]
    worst = max((max(r.second.values(), default=0.0), f"{r.layout} {r.precision} {r.model}") for r in rows)
    lines.append(f"worst second-perturbation ratio {worst[0]:.2f} ({worst[1]}); the limits are described in "
                 "mm_adaptor/harness/verdict.py")
    return "\n".join(lines)
