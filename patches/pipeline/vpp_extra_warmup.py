"""--vpp-extra-warmup: megatron's interleaved 1F1B schedule with K more warm-up forwards on every stage.

Megatron's interleaved schedule takes its warm-up length from get_pp_rank_microbatches and is otherwise written
for any length: after W warm-up forwards, steady step k runs the forward of virtual micro-batch k + W and the
backward of k, and the cool-down drains the rest. Adding the same K to every stage keeps the difference between
neighbouring stages (two), so every send still meets its receive; each stage has its next forward's input in hand
K steps earlier, so a late point-to-point transfer delays it less, for K more micro-batches of activations
held per stage. The order of the backward passes is megatron's, so gradients accumulate in the same order.

Also counts, per stage, the micro-batches whose forward ran and whose backward has not (the activations held):
the schedule's real peak, for the driver's statistics and the simulator's check; and times each forward and
backward pass with the device backend's timing events recorded on the compute stream (a host clock would measure
only the launches on a GPU). Events are read back when the next schedule starts or the statistics are read, so no
pass waits for the device. The CPU backend's events read the host clock, which there is the passes' own time (CPU
work runs to completion); `clock` says which one measured."""

from __future__ import annotations

import torch

from mm_adaptor.core.patching import bound_arguments


class InFlight:
    """Forward steps minus backward steps while gradients are on (evaluation does not count)."""

    def __init__(self):
        self.now = 0
        self.peak = 0
        self.schedules = 0
        self.first_step: list = []  # the first training schedule's passes: ("F", chunk, micro-batch) or ("B",)
        self.seconds = {"forward": 0.0, "backward": 0.0}
        self.calls = {"forward": 0, "backward": 0}
        self.backend = None  # the device backend whose events time the passes; the installed one when None
        self.pending: list = []  # (kind, start event, end event) not read back yet

    def forward(self):
        if torch.is_grad_enabled():
            self.now += 1
            self.peak = max(self.peak, self.now)

    def backward(self):
        self.now -= 1

    def timed(self, kind: str, seconds: float):
        self.seconds[kind] += seconds
        self.calls[kind] += 1

    def mean_ms(self, kind: str) -> float:
        self.read_back()
        return 1e3 * self.seconds[kind] / max(self.calls[kind], 1)

    # pass timing
    def _backend(self):
        from mm_adaptor import devices

        return self.backend or devices.current_or_chosen()

    @property
    def clock(self) -> str:
        backend = self._backend()
        if backend.name == "cpu":
            return "host clock (the CPU backend runs each pass to completion)"
        return f"{backend.name} timing events on the compute stream"

    def start_pass(self):
        event = self._backend().stream_module().Event(enable_timing=True)
        event.record()
        return event

    def end_pass(self, kind: str, start) -> None:
        end = self._backend().stream_module().Event(enable_timing=True)
        end.record()
        self.pending.append((kind, start, end))

    def read_back(self) -> None:
        """Add the recorded passes' times (waits for their end events: once per schedule, when the last step's
        work is normally done already)."""
        for kind, start, end in self.pending:
            end.synchronize()
            self.timed(kind, start.elapsed_time(end) / 1e3)
        self.pending.clear()


IN_FLIGHT = InFlight()


def warmup_with_extra(extra: int):
    """Wrapper of get_pp_rank_microbatches: K more warm-up micro-batches in the interleaved schedule (clipped to
    the total; a stage whose micro-batches are all in warm-up already keeps megatron's)."""

    def wrapper(wrapped, instance, args, kwargs):
        total, all_in_warmup, warmup, remaining = wrapped(*args, **kwargs)
        names = ("num_microbatches", "num_model_chunks", "microbatch_group_size_per_vp_stage", "forward_only")
        bound = bound_arguments(names, args, kwargs)
        IN_FLIGHT.read_back()  # the last schedule's pass times, before this one records more
        if bound.get("forward_only") or bound["num_model_chunks"] == 1 or all_in_warmup:
            return total, all_in_warmup, warmup, remaining
        warmup = min(warmup + extra, total)
        IN_FLIGHT.schedules += 1
        return total, warmup == total, warmup, total - warmup

    return wrapper


def counting_forward(wrapped, instance, args, kwargs):
    IN_FLIGHT.forward()
    if IN_FLIGHT.schedules == 1 and torch.is_grad_enabled():
        IN_FLIGHT.first_step.append(("F", kwargs.get("vp_stage"), kwargs.get("current_microbatch")))
    start = IN_FLIGHT.start_pass()
    result = wrapped(*args, **kwargs)
    IN_FLIGHT.end_pass("forward", start)
    return result


def counting_backward(wrapped, instance, args, kwargs):
    start = IN_FLIGHT.start_pass()
    result = wrapped(*args, **kwargs)
    IN_FLIGHT.end_pass("backward", start)
    IN_FLIGHT.backward()
    if IN_FLIGHT.schedules == 1:
        IN_FLIGHT.first_step.append(("B",))
    return result
