"""`mm-adaptor schedule`: a discrete-event simulator of pipeline schedules. It shows step time, bubble, the
micro-batches each stage holds, and a timeline, for Megatron's 1F1B, Megatron's interleaved 1F1B, and interleaved
with --vpp-extra-warmup, before anyone rents a cluster.

The order of work on each stage comes from Megatron's own functions: `get_pp_rank_microbatches` for the warm-up
length (wrapped by the adaptor's --vpp-extra-warmup patch for the third schedule) and `get_schedule_table` for which
micro-batch and model chunk each virtual step runs. The backward of virtual step k runs model chunk V - 1 - c.
Only the three-phase loop is written here, the same loop as `forward_backward_pipelining_with_interleaving`:
warm-up forwards, then steady pairs (forward k + W, backward k), then cool-down backwards.

Timing: a stage runs its work strictly in that order. A forward of virtual stage s (model chunk c on rank r is
virtual stage c x PP + r) waits for the forward of stage s - 1 plus one transfer; a backward waits for its own
forward and for the backward of stage s + 1 plus one transfer. A transfer costs latency + sent bytes / bandwidth and
overlaps compute (asynchronous point-to-point, as Megatron-LM's interleaved default). Bubble fraction = (step time
- ideal) / ideal, where ideal is one stage's compute alone, M x V x (forward + backward)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Op:
    kind: str  # "F" or "B"
    chunk: int
    microbatch: int


class _Group:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Communicator:
    """What Megatron's get_pp_rank_microbatches reads from a P2PCommunicator."""

    def __init__(self, pp: int, rank: int, vpp: int | None):
        self.pp_group = _Group(rank, pp)
        self.virtual_pipeline_model_parallel_size = vpp


def stage_order(pp: int, vpp: int, microbatches: int, rank: int, extra: int = 0) -> list[Op]:
    """The forward and backward passes of one pipeline rank, in the order Megatron's schedule runs them
    (vpp 1: 1F1B; extra > 0: interleaved with --vpp-extra-warmup)."""
    from megatron.core.pipeline_parallel import schedules

    if vpp == 1:
        if extra:
            raise ValueError("--vpp-extra-warmup extends the interleaved schedule: it needs --vpp 2 or more")
        comm = _Communicator(pp, rank, None)
        total, _, warmup, remaining = schedules.get_pp_rank_microbatches(microbatches, 1, pp, p2p_communicator=comm)
        table = [(m, 0) for m in range(microbatches)]
    else:
        comm = _Communicator(pp, rank, vpp)
        get_warmup = schedules.get_pp_rank_microbatches
        if extra:
            from mm_adaptor.patches.pipeline.vpp_extra_warmup import warmup_with_extra

            wrapper = warmup_with_extra(extra)

            def get_warmup(*args, **kwargs):
                return wrapper(schedules.get_pp_rank_microbatches, None, args, kwargs)
        total, _, warmup, remaining = get_warmup(microbatches, vpp, pp, p2p_communicator=comm)
        table = schedules.get_schedule_table(microbatches, vpp, pp)

    def forward(k):
        m, c = table[k]
        return Op("F", c, m)

    def backward(k):
        m, c = table[k]
        return Op("B", vpp - 1 - c, m)

    order = [forward(k) for k in range(warmup)]
    for k in range(remaining):
        order += [forward(k + warmup), backward(k)]
    order += [backward(k) for k in range(remaining, total)]
    return order


@dataclass
class Costs:
    forward: float  # seconds per forward of one model chunk of one micro-batch
    backward: float
    latency: float = 0.0  # seconds per point-to-point transfer
    bandwidth: float = math.inf  # bytes per second
    activation_bytes: float = 0.0  # what a chunk holds per micro-batch until its backward
    send_bytes: float = 0.0  # what a chunk sends its neighbour per micro-batch (the hidden states)

    def transfer(self) -> float:
        return self.latency + (self.send_bytes / self.bandwidth if self.bandwidth != math.inf else 0.0)


@dataclass
class Result:
    name: str
    step: float
    ideal: float
    peak_in_flight: list  # per stage: forwards run and not yet backwarded, in units of ops
    peak_activation_bytes: list
    timeline: list = field(default_factory=list)  # per stage: (start, end, Op)

    @property
    def bubble(self) -> float:
        return (self.step - self.ideal) / self.ideal


class Deadlock(RuntimeError):
    pass


def simulate(pp: int, vpp: int, microbatches: int, costs: Costs, extra: int = 0, name: str = "") -> Result:
    """One training step's pipeline, as the order above and the dependencies allow."""
    orders = [stage_order(pp, vpp, microbatches, r, extra) for r in range(pp)]
    stages = pp * vpp
    done: dict = {}
    clock, pointer = [0.0] * pp, [0] * pp
    timeline = [[] for _ in range(pp)]
    transfer = costs.transfer()
    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while pointer[r] < len(orders[r]):
                op = orders[r][pointer[r]]
                s = op.chunk * pp + r
                if op.kind == "F":
                    deps = [] if s == 0 else [("F", s - 1, op.microbatch, transfer)]
                    duration = costs.forward
                else:
                    deps = [("F", s, op.microbatch, 0.0)]
                    if s < stages - 1:
                        deps.append(("B", s + 1, op.microbatch, transfer))
                    duration = costs.backward
                if any(d[:3] not in done for d in deps):
                    break
                ready = max([clock[r], *(done[d[:3]] + d[3] for d in deps)])
                end = ready + duration
                done[(op.kind, s, op.microbatch)] = end
                timeline[r].append((ready, end, op))
                clock[r] = end
                pointer[r] += 1
                progressed = True
    if any(pointer[r] < len(orders[r]) for r in range(pp)):
        raise Deadlock(f"the schedule cannot proceed: stage {[pointer[r] for r in range(pp)]} of "
                       f"{[len(o) for o in orders]} ops")
    peaks = [_peak_in_flight(order) for order in orders]
    return Result(name=name, step=max(clock), ideal=microbatches * vpp * (costs.forward + costs.backward),
                  peak_in_flight=peaks, peak_activation_bytes=[p * costs.activation_bytes for p in peaks],
                  timeline=timeline)


def _peak_in_flight(order: list[Op]) -> int:
    now = peak = 0
    for op in order:
        now += 1 if op.kind == "F" else -1
        peak = max(peak, now)
    return peak


def compare(pp: int, vpp: int, microbatches: int, costs: Costs, extra: int = 1) -> list[Result]:
    """Megatron 1F1B (each op the work of vpp chunks), Megatron interleaved, interleaved + extra warm-up."""
    whole = Costs(costs.forward * vpp, costs.backward * vpp, costs.latency, costs.bandwidth,
                  costs.activation_bytes * vpp, costs.send_bytes)
    results = [simulate(pp, 1, microbatches, whole, name="megatron 1F1B")]
    if vpp > 1:
        results.append(simulate(pp, vpp, microbatches, costs, name="megatron interleaved"))
        results.append(simulate(pp, vpp, microbatches, costs, extra=extra,
                                name=f"interleaved + extra warm-up {extra}"))
    return results


def analytic_bubble(pp: int, vpp: int, microbatches: int) -> float:
    return (pp - 1) / (vpp * microbatches)


def table(results: list[Result], pp: int, vpp: int, microbatches: int) -> list[str]:
    lines = ["| schedule | step ms | bubble | analytic bubble (no communication) | peak micro-batches held per stage "
             "| peak activation MiB per stage |", "|---|---|---|---|---|---|"]
    for result in results:
        v = 1 if result.name == "megatron 1F1B" else vpp
        held = _per_stage([str(p) for p in result.peak_in_flight])
        mib = _per_stage([f"{b / 2**20:.1f}" for b in result.peak_activation_bytes])
        lines.append(f"| {result.name} | {result.step * 1e3:.3f} | {result.bubble:.4f} | "
                     f"{analytic_bubble(pp, v, microbatches):.4f} | {held} | {mib} |")
    return lines


def _per_stage(values: list[str]) -> str:
    """Every stage's value, or the first two and the last where there are more than 8 stages."""
    return ", ".join(values) if len(values) <= 8 else f"{values[0]}, {values[1]}, ..., {values[-1]}"


COLOURS = {"F": "#4c78a8", "B": "#59a14f"}


def svg(results: list[Result], path) -> None:
    """One panel per schedule, one row per stage; forwards blue, backwards green, waits left blank (grey row)."""
    scale = 900 / max(r.step for r in results)
    row, gap, left = 22, 34, 150
    height = sum(len(r.timeline) * row + gap for r in results) + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + 920}" height="{height}" '
             f'font-family="sans-serif" font-size="11">']
    y = 10
    for result in results:
        parts.append(f'<text x="4" y="{y + 12}" font-weight="bold">{result.name}: {result.step * 1e3:.2f} ms, '
                     f'bubble {result.bubble:.3f}</text>')
        y += 18
        for stage, ops in enumerate(result.timeline):
            parts.append(f'<text x="4" y="{y + 15}">stage {stage}</text>')
            parts.append(f'<rect x="{left}" y="{y}" width="{result.step * scale:.2f}" height="{row - 4}" '
                         f'fill="#e6e6e6"/>')
            for start, end, op in ops:
                parts.append(f'<rect x="{left + start * scale:.2f}" y="{y}" width="{(end - start) * scale:.2f}" '
                             f'height="{row - 4}" fill="{COLOURS[op.kind]}" stroke="white" stroke-width="0.5">'
                             f'<title>{op.kind} chunk {op.chunk} micro-batch {op.microbatch}</title></rect>')
            y += row
        y += gap - 18
    parts.append("</svg>")
    with open(path, "w") as out:
        out.write("\n".join(parts))


def main(argv: list[str]) -> int:
    from mm_adaptor.core.one_line_parser import ArgumentParser

    parser = ArgumentParser(prog="mm-adaptor schedule", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, required=True, help="pipeline stages")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per stage (1: plain 1F1B only)")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    parser.add_argument("--extra", type=int, default=1, help="--vpp-extra-warmup-microbatches (default 1)")
    parser.add_argument("--forward-ms", type=float, default=1.0, help="forward of one model chunk, one micro-batch")
    parser.add_argument("--backward-ms", type=float, default=2.0, help="backward of one model chunk")
    parser.add_argument("--p2p-latency-us", type=float, default=0.0)
    parser.add_argument("--p2p-gbs", type=float, default=math.inf, help="point-to-point bandwidth, GB/s")
    parser.add_argument("--activation-mib", type=float, default=0.0,
                        help="what one model chunk holds per micro-batch until its backward")
    parser.add_argument("--send-mib", type=float, default=0.0,
                        help="what one model chunk sends its neighbour per micro-batch (the hidden states)")
    parser.add_argument("--svg", default="schedule.svg", help="where the timeline picture goes")
    args = parser.parse_args(argv)
    import warnings

    with warnings.catch_warnings():  # megatron's notices about Transformer Engine and Apex, irrelevant here
        warnings.simplefilter("ignore")
        from megatron.core.pipeline_parallel import schedules  # noqa: F401
    if args.pp < 2:
        parser.fail(f"--pp {args.pp}: a pipeline schedule needs 2 or more stages")
    if args.vpp < 1 or args.microbatches < 1 or args.extra < 1:
        parser.fail("--vpp, --microbatches and --extra must be at least 1")
    if args.vpp > 1 and args.microbatches % args.pp:
        parser.fail(f"--microbatches {args.microbatches} must be a multiple of --pp {args.pp} for megatron's "
                    f"interleaved schedule")
    costs = Costs(args.forward_ms / 1e3, args.backward_ms / 1e3, args.p2p_latency_us / 1e6, args.p2p_gbs * 1e9,
                  args.activation_mib * 2**20, args.send_mib * 2**20)
    results = compare(args.pp, args.vpp, args.microbatches, costs, args.extra)
    print(f"# PP {args.pp}, VPP {args.vpp}, {args.microbatches} micro-batches; per chunk forward {args.forward_ms} ms, "
          f"backward {args.backward_ms} ms; transfer {costs.transfer() * 1e6:.1f} us")
    for line in table(results, args.pp, args.vpp, args.microbatches):
        print(line)
    svg(results, args.svg)
    print(f"timeline: {args.svg}")
    return 0
