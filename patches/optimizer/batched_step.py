"""The inner optimizer's step run over batches of its parameters, so that a feature can bring each batch's main
parameters and moments into place just before the update and put them away just after (bounded device memory).
Adam's update is elementwise per tensor, so any batching gives the same values as one step over all parameters."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def batches_by_bytes(tensors: Sequence[torch.Tensor], budget_bytes: int, bytes_per_element: int | None = None):
    """Consecutive index batches of `tensors`, each of at most budget_bytes (a larger tensor alone)."""
    batches, current, size = [], [], 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * (bytes_per_element or t.element_size())
        if current and size + nbytes > budget_bytes:
            batches.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    return batches + [current] if current else batches


def _settle(group: dict, settings: dict) -> None:
    """A param group's settings (everything but its params) as they were, keys the step added included."""
    for key in [k for k in group if k != "params" and k not in settings]:
        del group[key]
    group.update(settings)


def step_in_batches(inner: torch.optim.Optimizer, batches: list[list[torch.Tensor]],
                    before: Callable[[int], None], after: Callable[[int], None]) -> None:
    """inner.step() once per batch of its params (tensors the batches name; the params no batch names step with
    the first), with before(i) / after(i) around batch i. Group settings a step changes (an optimizer that counts
    steps per group, as Transformer Engine's FusedAdam does) end as after one step over all params."""
    groups = inner.param_groups
    originals = [group["params"] for group in groups]
    settings = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    named = {id(t) for batch in batches for t in batch}
    settled = list(settings)
    try:
        for n, batch in enumerate(batches or [[]]):
            members = {id(t) for t in batch}
            before(n)
            for group, params, setting in zip(groups, originals, settings):
                _settle(group, setting)
                group["params"] = [p for p in params if id(p) in members or (n == 0 and id(p) not in named)]
            inner.step()
            for g, group in enumerate(groups):
                if group["params"]:
                    settled[g] = {k: v for k, v in group.items() if k != "params"}
            after(n)
    finally:
        for group, params, setting in zip(groups, originals, settled):
            _settle(group, setting)
            group["params"] = params
