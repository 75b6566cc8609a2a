"""How a run with features is judged against the unpatched run.

Bit-for-bit features: every loss, every module output of the first micro-batch, every step's gradients and the final
parameters must be equal.

Inexact features are judged against the rounding noise of the same configuration: the unpatched model trained again
with every matrix product (forward and backward) summed in two halves of its inner dimension and again in thirds
(split_k.py: the same math, another rounding; cached like the baseline), the larger of the two draws counting at
every step (from step 2 on, the differences come mostly from the few parameters whose gradient is below Adam's eps,
each moved by lr x its gradient's rounding change / eps, where one draw can be zero; at step 1 one draw can sit low
at one kind: compare.NOISE_PARTS). On a device that is not bitwise reproducible from run to run (CUDA, NPU), an
unperturbed repeat of the unpatched run is a third draw: the device's own nondeterminism is a floor.
Each comparison point gets three scale-free statistics (the loss gets one):
  rel_norm  ‖Δ‖ / ‖off‖             how far it moved overall
  scale     |⟨Δ, off⟩| / ‖off‖²     a systematic scale error, which rounding noise hardly produces
  rel_max   max|Δ| / max|off|       a few elements far off
A point passes when each statistic is at most K x its noise level: the largest noise of its kind at its step
(a kind groups tensors across layers, experts and ranks: 'decoder.layers.*.mlp.linear_fc2.weight'), or, where one
noise sample is too unsteady to trust, what rounding noise of that kind's rel_norm would give spread over the
tensor's nonzero elements, or the floor: what one rounding of every element in the precision gives, whichever is
largest. A module output's scale floor shrinks like 1/sqrt(n) (scale_floor), so an error below one rounding per
element but of one sign everywhere stands out of a large output as it stands out of rounding noise. Gradients keep
a fixed scale floor (u/16): a weight gradient sums the step's tokens, so its rounding noise is shared along their
directions and does not average out over its elements (the second perturbation's step-1 qkv weight gradient in
PP2 bf16 llama: scale 7.8e-4, 3.9 x rel_norm/sqrt(n_eff)).
K is K_FIRST_STEP at step 1, where only one forward and backward rounded differently, and K_LATER_STEPS after it,
where Adam's sign-like updates and MoE routing flips turn rounding into discrete, heavy-tailed differences.
Points:
  loss          per step
  activations   outputs of each layer's norms, attention and MLP and of the layer, first micro-batch of step 1
  gradients     every parameter, every step (before the optimizer step)
  parameters    what training did to them: rel_norm of Δ relative to (final - initial) of the unpatched run, at most
                PARAMETER_UPDATE_LIMIT (Adam normalises gradient scale away: gradients carry the fine verdict)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mm_adaptor.core.features import Tolerance
from mm_adaptor.harness.expert_view import assemble_experts, expert_layouts_differ, not_expert  # noqa: F401

if TYPE_CHECKING:  # torch is imported where tensors are judged, so `mm-adaptor check` refuses bad input fast
    import torch

STATISTICS = ("rel_norm", "scale", "rel_max")
GROUPS = ("loss", "activations", "gradients", "parameters")

# Chosen on 57 legitimate rounding changes (a second perturbation in 23 layout x precision x model configurations;
# the fused features in 34 configurations), all at most 0.94 of their limits, and the two subtle bugs of the
# self-test, at least 2.03 times theirs in bf16; with the size-scaled floor (issue 27) the second perturbation in all
# 24 configurations is at most 0.98 (a gradient; module outputs 0.88, as before) and the three subtle bugs at least
# 2.42 (benchmarks/RESULTS.md, "Harness calibration").
K_FIRST_STEP = 4.0
K_LATER_STEPS = 40.0
ISOTROPIC_ALLOWANCE = 2.0
PARAMETER_UPDATE_LIMIT = 1.0
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}


def floors(precision: str) -> dict[str, float]:
    """What one correctly rounded difference can produce where the perturbation happens to change nothing (a module
    output's scale floor depends on its size: scale_floor)."""
    u = UNIT_ROUNDOFF[precision]
    return {"loss": max(2.0**-22, u / 256), "rel_norm": u, "scale": u / 16, "rel_max": 2 * u}


def energy_count(ref: torch.Tensor) -> float:
    """(sum x^2)^2 / sum x^4: how many elements carry the tensor's energy (n if all are equal, fewer if a few
    dominate; unused embedding rows count for nothing)."""
    squares = ref.double().square()
    fourth = float(squares.square().sum())
    return float(squares.sum()) ** 2 / fourth if fourth else 1.0


def scale_floor(precision: str, ref: torch.Tensor) -> float:
    """The scale statistic of one rounding of every element. Rounding x_i to x_i(1 + e_i), e_i independent with
    mean 0 and |e_i| <= u (standard deviation <= u/sqrt(3)), gives scale |sum x_i^2 e_i| / sum x_i^2, whose standard
    deviation is at most u / sqrt(3 n_eff) with n_eff = energy_count(x): rounding's systematic part shrinks like
    1/sqrt(n). ISOTROPIC_ALLOWANCE standard deviations, as for a measured sample (the largest of a few)."""
    return ISOTROPIC_ALLOWANCE * UNIT_ROUNDOFF[precision] / math.sqrt(3 * energy_count(ref))


def precision_of(args: dict) -> str:
    return "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32"


_NUMBERED = [(re.compile(r"^chunk\d+\."), ""), (re.compile(r"(layers|local_experts|global_experts)\.\d+"), r"\1.*"),
             (re.compile(r"\bL\d+\."), "L*.")]


def kind_of(name: str) -> str:
    for pattern, replacement in _NUMBERED:
        name = pattern.sub(replacement, name)
    return name


def statistics(off: torch.Tensor, on: torch.Tensor, reference: torch.Tensor | None = None) -> dict[str, float]:
    """The three statistics of on against off, relative to `reference` (default: off)."""
    ref = (off if reference is None else reference).double()
    delta = on.double() - off.double()
    ref_norm, delta_norm = float(ref.norm()), float(delta.norm())
    if delta_norm == 0:
        return dict.fromkeys(STATISTICS, 0.0)
    if ref_norm == 0:
        return dict.fromkeys(STATISTICS, math.inf)
    return {
        "rel_norm": delta_norm / ref_norm,
        "scale": abs(float((delta * ref).sum())) / ref_norm**2,
        "rel_max": float(delta.abs().max()) / float(ref.abs().max()),
    }


def loss_statistic(off: float, on: float) -> float:
    return abs(on - off) / abs(off) if off else (0.0 if on == off else math.inf)


@dataclass(frozen=True)
class Point:
    group: str
    step: int
    rank: int
    name: str
    off: object
    on: object
    reference: object = None

    @property
    def where(self) -> str:
        return f"step {self.step} rank {self.rank} {self.name}"

    @property
    def kind(self) -> tuple:
        return self.group, kind_of(self.name), self.step


def points(off, on, whole_experts: bool = False):
    """Every comparison point of two dumps of the same configuration. whole_experts: the expert parameters and
    their gradients are compared whole, by global expert index (assembled from every rank: assemble_experts), for two
    runs whose ranks hold other experts or other slices of them (expert_layouts_differ)."""
    for step, (a, b) in enumerate(zip(off.losses, on.losses), start=1):
        yield Point("loss", step, 0, "lm loss", a, b)
    local = not_expert if whole_experts else dict
    for r_off, r_on in zip(off.ranks, on.ranks):
        rank = r_off.rank
        yield from _named("activations", 1, rank, r_off.activations, r_on.activations)
        for step, (g_off, g_on) in enumerate(zip(r_off.grads, r_on.grads), start=1):
            yield from _named("gradients", step, rank, local(g_off), local(g_on))
        updates = {n: r_off.params[n] - r_off.initial_params[n] for n in r_off.params if n in r_off.initial_params}
        yield from _named("parameters", len(r_off.grads), rank, local(r_off.params), local(r_on.params), updates)
    if whole_experts:
        yield from _whole_expert_points(off, on)


def _whole_expert_points(off, on):
    steps = min(min((len(r.grads) for r in off.ranks), default=0), min((len(r.grads) for r in on.ranks), default=0))
    for step in range(steps):
        yield from _assembled("gradients", step + 1, off, on, lambda r, s=step: r.grads[s])
    params_off = assemble_experts(off, lambda r: r.params)
    initial_off = assemble_experts(off, lambda r: r.initial_params)
    updates = {k: t - initial_off[k][1] for k, (_, t) in params_off.items() if k in initial_off}
    final = len(off.ranks[0].grads) if off.ranks else 0
    yield from _assembled("parameters", final, off, on, lambda r: r.params, updates, params_off)


def _assembled(group, step, off, on, tensors_of, references=None, assembled_off=None):
    a = assembled_off if assembled_off is not None else assemble_experts(off, tensors_of)
    b = assemble_experts(on, tensors_of)
    for key in sorted(set(a) | set(b)):
        rank = (a.get(key) or b.get(key))[0]
        yield Point(group, step, rank, key, (a.get(key) or (None, None))[1], (b.get(key) or (None, None))[1],
                    (references or {}).get(key))


def _named(group, step, rank, off: dict, on: dict, references: dict | None = None):
    for name in sorted(set(off) | set(on)):
        yield Point(group, step, rank, name, off.get(name), on.get(name), (references or {}).get(name))


def point_statistics(point: Point) -> dict[str, float]:
    if point.group == "loss":
        return {"loss": loss_statistic(point.off, point.on)}
    return statistics(point.off, point.on, point.reference)


def _shape_problem(point: Point) -> str | None:
    if point.group == "loss":
        return None
    if point.off is None or point.on is None:
        return f"{point.where}: recorded in only one run"
    if point.off.shape != point.on.shape:
        return f"{point.where}: shape {tuple(point.off.shape)} vs {tuple(point.on.shape)}"
    return None


def noise_table(off, *draws, whole_experts: bool = False) -> dict[tuple, dict[str, float]]:
    """The largest statistic of each kind at each step over the noise draws: the rounding perturbations (one draw
    at the parameters below Adam's eps can be zero, and at step 1 one draw can sit low at a kind where the feature's
    legitimate rounding change does not: compare.NOISE_PARTS) and, on a device that is not bitwise reproducible, an
    unperturbed repeat of the unpatched run."""
    table: dict[tuple, dict[str, float]] = {}
    for draw in draws:
        for point in points(off, draw, whole_experts):
            if _shape_problem(point):
                continue
            largest = table.setdefault(point.kind, {})
            for stat, value in point_statistics(point).items():
                largest[stat] = max(largest.get(stat, 0.0), value)
    return table


@dataclass
class Limits:
    """The limit of each statistic at each point (module docstring); None noise means bit-for-bit."""

    precision: str
    noise: dict | None
    factor: float = 1.0

    @property
    def exact(self) -> bool:
        return self.noise is None

    def of(self, point: Point, stat: str) -> float | None:
        """None: the statistic is not judged at this point."""
        if point.group == "parameters":
            return PARAMETER_UPDATE_LIMIT * self.factor if stat == "rel_norm" else None
        measured = self.noise.get(point.kind, {})
        level = max(measured.get(stat, 0.0), self._floor(point, stat))
        if point.group != "loss" and stat in ("scale", "rel_max"):
            level = max(level, _spread_noise(point, stat, measured.get("rel_norm", 0.0)))
        k = K_FIRST_STEP if point.step == 1 else K_LATER_STEPS
        return k * self.factor * level

    def _floor(self, point: Point, stat: str) -> float:
        if stat == "scale" and point.group == "activations":
            return scale_floor(self.precision, point.off if point.reference is None else point.reference)
        return floors(self.precision)[stat]

    def describe(self) -> str:
        if self.exact:
            return "bit-for-bit"
        scale = f" x{self.factor:g}" if self.factor != 1 else ""
        return (f"each statistic <= {K_FIRST_STEP:g}{scale} (step 1) / {K_LATER_STEPS:g}{scale} (later steps) x this "
                f"configuration's rounding noise of its kind (floor: one {self.precision} rounding of each element); "
                f"parameter updates differ by at most {PARAMETER_UPDATE_LIMIT:g}{scale} x their own size")


def _spread_noise(point: Point, stat: str, rel_norm_noise: float) -> float:
    """What noise of relative norm `rel_norm_noise`, spread at random over the tensor's nonzero elements, gives."""
    ref = (point.off if point.reference is None else point.reference).double()
    n = max(1, int(ref.count_nonzero()))
    if stat == "scale":
        return ISOTROPIC_ALLOWANCE * rel_norm_noise / math.sqrt(n)
    largest = float(ref.abs().max())
    if largest == 0:
        return 0.0
    return ISOTROPIC_ALLOWANCE * rel_norm_noise * float(ref.norm()) / largest * math.sqrt(2 * math.log(max(n, 2)) / n)


@dataclass
class Worst:
    ratio: float = 0.0  # value / limit (inexact) or the value itself (bit-for-bit)
    stat: str = ""
    value: float = 0.0
    limit: float = 0.0
    where: str = ""


@dataclass
class GroupVerdict:
    group: str
    count: int = 0
    worst: Worst = field(default_factory=Worst)
    largest: dict = field(default_factory=dict)  # statistic -> largest value seen
    failures: list = field(default_factory=list)

    def add(self, point: Point, limits: Limits) -> None:
        self.count += 1
        problem = _shape_problem(point)
        if problem:
            self.failures.append(problem)
            return
        stats = point_statistics(point)
        for stat, value in stats.items():
            self.largest[stat] = max(self.largest.get(stat, 0.0), value)
        if limits.exact:
            if not _equal(point.off, point.on):
                self.failures.append(f"{point.where}: not bit-for-bit ({_describe(stats)})")
            largest = max(stats, key=stats.get)
            if not stats[largest] <= self.worst.value:
                self.worst = Worst(stats[largest], largest, stats[largest], 0.0, point.where)
            return
        over = []
        for stat, value in stats.items():
            limit = limits.of(point, stat)
            if limit is None:
                continue
            ratio = value / limit
            if not ratio <= self.worst.ratio:
                self.worst = Worst(ratio, stat, value, limit, point.where)
            if not value <= limit:
                over.append(f"{stat} {value:.2e} > {limit:.1e}")
        if over:
            self.failures.append(f"{point.where}: {', '.join(over)}")


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _describe(stats: dict) -> str:
    return ", ".join(f"{k} {v:.2e}" for k, v in stats.items())


def judge(off, on, limits: Limits, skip: tuple[str, ...] = (),
          whole_experts: bool = False) -> dict[str, GroupVerdict]:
    """skip: groups not comparable between the two runs (e.g. activations, where the feature's layout hands each
    rank other tokens than the unpatched one's). whole_experts: see points."""
    verdicts = {group: GroupVerdict(group) for group in GROUPS if group not in skip}
    for point in points(off, on, whole_experts):
        if point.group not in skip:
            verdicts[point.group].add(point, limits)
    if len(off.losses) != len(on.losses):
        verdicts["loss"].failures.append(f"{len(off.losses)} vs {len(on.losses)} steps")
    for r_off, r_on in zip(off.ranks, on.ranks):
        if len(r_off.grads) != len(r_on.grads):
            verdicts["gradients"].failures.append(
                f"rank {r_off.rank}: {len(r_off.grads)} vs {len(r_on.grads)} steps recorded")
    return verdicts


def limits_for(tolerance: Tolerance, precision: str, noise_table_or_none) -> Limits:
    if tolerance.exact:
        return Limits(precision, None)
    return Limits(precision, noise_table_or_none or {}, tolerance.factor)
