"""Swap attention's layer selection (patches.transformer.swap_attention's `select`): the timed passes of a block,
the link's achieved rate and which layers' copies it can hide."""

from __future__ import annotations

import dataclasses

SELECT_MODES = ("bandwidth", "all")
DEFAULT_SELECT = "bandwidth"
# passes of a block timed before its layers are chosen; the choice uses the last (the first carries one-time costs:
# host buffer allocation, kernel selection)
MEASURED_PASSES = 2


@dataclasses.dataclass
class LayerTiming:
    """One layer of a measured block pass. window_ms: compute-stream time from this layer's forward end to the next
    layer's (to the block's end for the block's last layer), the compute its copy out runs beside; copied_bytes and
    copy_ms: what its swap copied to host memory in that pass and how long the offload stream took (0: not swapped);
    last: the block's last layer (never chosen)."""

    number: int
    window_ms: float
    copied_bytes: int = 0
    copy_ms: float = 0.0
    last: bool = False


def link_bytes_per_ms(timings) -> float | None:
    """The link's achieved rate in a measured pass: bytes copied out over the offload stream's time for them."""
    copied = sum(t.copied_bytes for t in timings)
    ms = sum(t.copy_ms for t in timings if t.copied_bytes)
    return copied / ms if copied and ms > 0 else None


def gb_per_s(bytes_per_ms: float | None) -> float | None:
    return None if bytes_per_ms is None else bytes_per_ms / 1e6


def select_layers(timings, bytes_per_ms: float | None) -> list[bool]:
    """Which layers of a block pass swap, in forward order: layer L if copied_bytes / bytes_per_ms <= window_ms, i.e.
    its copy out, started when its forward ends, is done when the next layer's forward ends. (The copies of a chosen
    layer are then done before the next layer's can start, so no copy waits behind another's.) The block's last
    layer, layers that copied nothing and every layer without a measured rate are not chosen."""
    return [bool(not t.last and t.copied_bytes and bytes_per_ms and t.copied_bytes / bytes_per_ms <= t.window_ms)
            for t in timings]


class MeasuredLayer:
    """Timing events of one layer in a measured pass (compute stream: its forward's end; offload stream: its copies)."""

    def __init__(self, number: int, last: bool, end):
        self.number, self.last, self.end = number, last, end
        self.copy_start = self.copy_end = None
        self.copied_bytes = 0


class MeasuredPass:
    """Timing events of one block pass: its start, each layer, its end (compute stream)."""

    def __init__(self, start):
        self.start, self.end = start, None
        self.layers: list[MeasuredLayer] = []


def device_timings(measured: MeasuredPass) -> list[LayerTiming]:
    """LayerTimings from a pass's events (waits for them once). The stand-in sources of the tests replace this."""
    measured.end.synchronize()
    timings = []
    for index, layer in enumerate(measured.layers):
        following = measured.layers[index + 1].end if index + 1 < len(measured.layers) else measured.end
        copy_ms = 0.0
        if layer.copied_bytes:
            layer.copy_end.synchronize()
            copy_ms = layer.copy_start.elapsed_time(layer.copy_end)
        timings.append(LayerTiming(layer.number, layer.end.elapsed_time(following), layer.copied_bytes, copy_ms,
                                   layer.last))
    return timings


class BlockPlan:
    """What one TransformerBlock (one model chunk: a virtual stage's) swaps: every candidate while its first passes
    are measured, then the layers select_layers chose (by layer number)."""

    def __init__(self):
        self.measured: list[MeasuredPass] = []
        self.chosen: set[int] | None = None
        self.timings: list[LayerTiming] | None = None
