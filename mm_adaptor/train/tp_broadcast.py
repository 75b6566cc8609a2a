"""Tensor-parallel peers take their batches from the group's first rank, as Megatron's get_batch does: one rank of
the group reads, decodes and tokenizes; the others receive each batch by broadcast (its layout first, then each
tensor), so every peer trains on the same bytes and only one pays for the data."""

from __future__ import annotations

import dataclasses


class TensorParallelBroadcast:
    """The batches of `source` on the tensor-parallel group's first rank, the same batches received on the others
    (whose `source` is never read). With packs (`packed`), the first rank packs each step (start_step) and the
    others learn how many packs it made. Other attributes (the step's token counts, the samples skipped) are the
    source's: meaningful on the first rank, which is the one that counts (step_log)."""

    def __init__(self, source, group, first_rank: int, device, packed: bool = False):
        import torch.distributed as dist

        self.source, self.group, self.first_rank, self.device = source, group, first_rank, device
        self.reads, self.packed = dist.get_rank() == first_rank, packed
        self.step = None  # (packs, tokens) of the current step, with packs

    def __getattr__(self, name):
        if name in ("microbatches_this_step", "tokens_this_step") and self.__dict__.get("step") is not None:
            return self.step[0 if name == "microbatches_this_step" else 1]
        return getattr(self.source, name)

    def __iter__(self):
        return self

    def start_step(self) -> None:
        import torch.distributed as dist

        if not self.packed:
            getattr(self.source, "start_step", lambda: None)()
            return
        if self.reads:
            self.source.start_step()
        step = [(self.source.microbatches_this_step, self.source.tokens_this_step) if self.reads else None]
        dist.broadcast_object_list(step, src=self.first_rank, group=self.group, device=_object_device(self.device))
        self.step = step[0]

    def __next__(self) -> dict:
        import torch.distributed as dist

        if self.reads:
            batch = {name: _contiguous(value) for name, value in next(self.source).items()}
            layout = [_layout(batch)]
        else:
            layout = [None]
        dist.broadcast_object_list(layout, src=self.first_rank, group=self.group, device=_object_device(self.device))
        if not self.reads:
            batch = _empty(layout[0], self.device)
        for value in batch.values():
            for tensor in _tensors(value):
                dist.broadcast(tensor, src=self.first_rank, group=self.group)
        return batch


def _object_device(device):
    import torch

    device = torch.device(device)
    return None if device.type == "cpu" else device


def _layout(batch: dict) -> dict:
    """name -> None, ("tensor", shape, dtype) or ("fields", class, {field: layout}) (a PackedSeqParams)."""
    def of(value):
        import torch

        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return ("fields", type(value), {f.name: of(getattr(value, f.name)) for f in dataclasses.fields(value)})
        return ("value", value)

    return {name: of(value) for name, value in batch.items()}


def _empty(layout: dict, device) -> dict:
    import torch

    def made(entry):
        kind = entry[0]
        if kind == "tensor":
            return torch.empty(entry[1], dtype=entry[2], device=device)
        if kind == "fields":
            return entry[1](**{name: made(sub) for name, sub in entry[2].items()})
        return entry[1]

    return {name: made(entry) for name, entry in layout.items()}


def _contiguous(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.contiguous()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _contiguous(getattr(value, f.name))
                                             for f in dataclasses.fields(value)
                                             if isinstance(getattr(value, f.name), torch.Tensor)})
    return value


def _tensors(value):
    """The tensors of a batch value, in a fixed order (a dataclass's fields in their order)."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _tensors(getattr(value, field.name))
