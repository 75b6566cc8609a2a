"""Calibration of the inexact verdict: how far does unpatched Megatron move when only its rounding changes?

The perturbation sums every matrix product in parts along its inner dimension (two halves by default:
x[:, :k/2] @ w[:k/2] + x[:, k/2:] @ w[k/2:]): the same math in a different reduction order, with one more rounding
of each output element in the working dtype. It covers the forward of every linear layer and attention product and
the backward GEMMs of megatron's linear layers. The harness runs it once per configuration (cached) as that
configuration's noise reference, and for the later steps also in thirds (compare.NOISE_PARTS: from step 2 on the
noise is dominated by the few parameters below Adam's eps, where one draw can be zero); `mm-adaptor calibrate` also
judges a further perturbation (fifths) against them, which must pass: a legitimate change of rounding is not a
failure.

The perturbation itself (a feature registered when split_k.py is imported) lives in split_k.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from mm_adaptor.harness.compare import compare, extra_feature_module
from mm_adaptor.harness.split_k import FLAG, MODULE, PARTS_FLAG

MODELS = {"gpt": [], "llama": ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope"]}
PRECISIONS = {"fp32": [], "bf16": ["--bf16"]}
SECOND_PARTS = 5  # the self-test's perturbation: not one of compare.NOISE_PARTS, which set the limits


@dataclass
class NoiseRow:
    layout: str
    precision: str
    model: str
    noise: dict  # group -> statistic -> largest noise
    second: dict  # group -> worst ratio of the fifths perturbation to the limits


def calibrate(layouts, precisions, models, *, iters: int = 4, progress=None) -> list[NoiseRow]:
    """Per configuration: the noise references' largest statistics, and a further rounding perturbation (fifths)
    judged by the harness against the limits they set (it must pass)."""
    rows = []
    with extra_feature_module(MODULE):
        for layout in layouts:
            for precision in precisions:
                for model in models:
                    c = compare([FLAG, PARTS_FLAG, str(SECOND_PARTS)], layout=layout,
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
             "worst ratio of a further perturbation (fifths) to the harness's limits (must be below 1):", header]
    lines += [_format_row(row) for row in rows]
    worst = max((max(r.second.values(), default=0.0), f"{r.layout} {r.precision} {r.model}") for r in rows)
    lines.append(f"worst second-perturbation ratio {worst[0]:.2f} ({worst[1]}); the limits are described in "
                 "mm_adaptor/harness/verdict.py")
    return "\n".join(lines)
