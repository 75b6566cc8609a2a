"""Calibration of the inexact verdict: how far does unpatched Megatron move when only its rounding changes?

The perturbation sums every matrix product in parts along its inner dimension (two halves by default:
x[:, :k/2] @ w[:k/2] + x[:, k/2:] @ w[k/2:]): the same math in a different reduction order, with one more rounding
of each output element in the working dtype. It covers the forward and backward GEMMs of every linear layer and
attention product. The harness runs it in halves and in thirds (compare.NOISE_PARTS, cached like the baseline), and
on a device that is not bitwise reproducible an unperturbed repeat too, as the configuration's noise references;
`mm-adaptor calibrate` also judges a further perturbation (fifths) against the limits they set, which must pass: a
legitimate change of rounding is not a failure. It stores that worst ratio per device type, layout, precision and
model (device_calibration.py), which `check` reads.

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
                                extra_args=[*MODELS[model], *PRECISIONS[precision]], iters=iters,
                                device_calibrated=False)
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
    lines = ["Largest rounding noise per configuration (unpatched vs every matrix product split in halves and in "
             "thirds), and the worst ratio of a further perturbation (fifths) to the harness's limits (must be below "
             "1):", header]
    lines += [_format_row(row) for row in rows]
    worst = max((max(r.second.values(), default=0.0), f"{r.layout} {r.precision} {r.model}") for r in rows)
    lines.append(f"worst second-perturbation ratio {worst[0]:.2f} ({worst[1]}); the limits are described in "
                 "mm_adaptor/harness/verdict.py")
    return "\n".join(lines)


def device_and_versions() -> tuple[str, dict]:
    """The device type the calibration ran on and what it ran with (stored beside each entry)."""
    import importlib.metadata

    import torch

    from mm_adaptor import devices

    backend = devices.current_or_chosen()
    versions = {"torch": torch.__version__, "megatron_core": importlib.metadata.version("megatron-core")}
    if backend.name == "cuda" and torch.cuda.is_available():
        versions["device_name"] = torch.cuda.get_device_name()
    return backend.name, versions
