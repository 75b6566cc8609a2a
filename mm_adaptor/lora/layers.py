"""LoRA on megatron-core's tensor-parallel linears: y = base(x) + B(A(dropout(x))) * alpha / r, in the layer itself.

A linear gets its adapter by a class swap (`add_adapter`): it stays a ColumnParallelLinear or RowParallelLinear (the
features that patch those classes, the schedules and the checkpoint code see the layer they know; the adapter's
share joins megatron's own linear output, under whatever a subclass does to it), its own weight
keeps its name (`linear_qkv.weight`), and the factors sit beside it as `linear_qkv.lora_A.weight` /
`linear_qkv.lora_B.weight`, the names peft gives them without its adapter name.

Tensor parallelism (the base's group; y's layout is the base's):
- column-parallel base (output rows split): A [r, in] whole on every rank, B [out / tp, r] split by rows. The
  gradient of A(x) is summed over the ranks' B shards (copy_to: all-reduce in backward); with sequence parallelism
  A(x) of the rank's tokens is gathered (and its gradient reduce-scattered), A's own gradient is then one of the
  ranks' tokens, summed by megatron as for any sequence-parallel parameter (`sequence_parallel`).
- row-parallel base (input columns split): A [r, in / tp] split by columns, B [out, r] whole. A(x) is summed over
  the ranks (reduce-scattered over the tokens with sequence parallelism, B's gradient then per rank's tokens).
A factor split across ranks carries megatron's tensor-parallel attributes (its gradient norm counts every shard
once), and its checkpoint entry is split on the same axis, so an adapter saved at one TP size loads at another.
A gated fc1's B (rows [gate; up], each split) is saved as megatron saves that fc1's weight."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

LORA_A, LORA_B = "lora_A", "lora_B"


@dataclass(frozen=True)
class AdapterShape:
    """One linear's adapter: its rank, alpha (scaling alpha / r), dropout and whether the base is an fc1 whose rows
    are [gate; up] (a gated MLP's)."""

    r: int
    alpha: float
    dropout: float = 0.0
    gated: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def is_adapter_key(key: str) -> bool:
    return f".{LORA_A}." in key or f".{LORA_B}." in key or key.startswith((f"{LORA_A}.", f"{LORA_B}."))


class _Factor(nn.Module):
    """Holds one factor's weight, so that its state-dict name is `lora_A.weight`."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)


def _kind(layer) -> str:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if isinstance(layer, ColumnParallelLinear):
        return "column"
    if isinstance(layer, RowParallelLinear):
        return "row"
    raise TypeError(f"{type(layer).__name__} is not a megatron-core tensor-parallel linear")


def unsupported(layer) -> str | None:
    """Why this linear takes no adapter here, or None."""
    kind = _kind(layer)
    if kind == "column" and getattr(layer, "gather_output", False):
        return "it gathers its output (a column-parallel linear with gather_output)"
    if kind == "row" and not getattr(layer, "input_is_parallel", True):
        return "it splits its own input (a row-parallel linear without input_is_parallel)"
    if getattr(layer, "delay_wgrad_compute", False):
        return "it delays its weight gradient (delay_wgrad_compute)"
    return None


def initial_a(rows: int, columns: int, seed: int, name: str) -> torch.Tensor:
    """A's whole initial value, as peft's default (kaiming-uniform, a = sqrt(5)), from a generator of the run's seed
    and the module's name: every rank and every tensor-parallel size start from the same adapter."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    bound = 1 / math.sqrt(columns)  # kaiming_uniform_ with a = sqrt(5): gain sqrt(2 / 6), bound gain * sqrt(3 / fan_in)
    return torch.empty(rows, columns).uniform_(-bound, bound, generator=generator)


def mark_sequence_parallel(whole: torch.Tensor, layer) -> None:
    """Under sequence parallelism a factor every rank holds whole gets a gradient from the rank's tokens alone:
    megatron sums such parameters' gradients over the tensor-parallel ranks (finalize_model_grads). An expert's
    linear sees every token of its expert-TP group (the dispatcher gathers them): not so."""
    whole.sequence_parallel = bool(layer.sequence_parallel) and not _expert_comm(layer)


def _expert_comm(layer) -> bool:
    """An MoE expert's linear whose communication the token dispatcher does (megatron's explicit_expert_comm)."""
    return bool(getattr(layer, "explicit_expert_comm", False))


_SWAPPED: dict[type, type] = {}


def add_adapter(layer, shape: AdapterShape, seed: int, name: str) -> None:
    """Give a megatron linear its adapter in place (its class swapped for the LoRA one of that class): A from
    initial_a, B zero, so that the output is the base's until B trains."""
    from megatron.core import tensor_parallel

    problem = unsupported(layer)
    if problem:
        raise ValueError(f"{name}: {problem}")
    kind = _kind(layer)
    base = layer.weight
    tp_size = layer.tp_group.size() if getattr(layer, "tp_group", None) is not None else 1
    tp_rank = layer.tp_group.rank() if tp_size > 1 else 0
    whole_a = initial_a(shape.r, layer.input_size, seed, name)
    if kind == "column":
        a = whole_a
        b = torch.zeros(layer.output_size_per_partition, shape.r)
    else:
        a = whole_a.chunk(tp_size, dim=1)[tp_rank]
        b = torch.zeros(layer.output_size, shape.r)
    layer.lora_A = _Factor(a.to(device=base.device, dtype=base.dtype))
    layer.lora_B = _Factor(b.to(device=base.device, dtype=base.dtype))
    split, whole = (layer.lora_B.weight, layer.lora_A.weight) if kind == "column" else (layer.lora_A.weight,
                                                                                       layer.lora_B.weight)
    tensor_parallel.set_tensor_model_parallel_attributes(split, True, 0 if kind == "column" else 1, 1)
    tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(whole)
    mark_sequence_parallel(whole, layer)
    for factor in (split, whole):  # an expert's: in the expert-data-parallel gradient buffers, as its weight
        factor.allreduce = getattr(base, "allreduce", True)
    layer.lora_shape, layer.lora_kind = shape, kind
    layer.__class__ = _with_adapter(type(layer), kind)


def _with_adapter(cls: type, kind: str) -> type:
    """The class `cls` with LoRA's forward right above megatron's own linear: a subclass that scales or biases the
    linear's output (InternViT's layer scale) then does so to the adapter's share too, as the Hugging Face module
    around peft's wrapped linear does."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if cls not in _SWAPPED:
        megatron = ColumnParallelLinear if kind == "column" else RowParallelLinear
        if megatron not in _SWAPPED:
            _SWAPPED[megatron] = type(f"Lora{megatron.__name__}", (LoraLinear, megatron), {})
        if cls is not megatron:
            _SWAPPED[cls] = type(f"Lora{cls.__name__}", (cls, _SWAPPED[megatron]), {})
    return _SWAPPED[cls]


class LoraLinear:
    """The forward and checkpoint entries of a megatron linear with an adapter (mixed in by add_adapter)."""

    lora_shape: AdapterShape
    lora_kind: str

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        return output + self.lora_delta(input_).to(output.dtype), bias

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        shape, group = self.lora_shape, self.tp_group
        x = self._lora_dropout(x)
        if _expert_comm(self):
            return self._expert_lora_delta(x, mappings)
        h = F.linear(x, self.lora_A.weight)
        if self.lora_kind == "column":
            if self.sequence_parallel:
                h = mappings.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=group)
            else:
                h = mappings.copy_to_tensor_model_parallel_region(h, group=group)
        elif self.sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=group)
        else:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=group)
        return F.linear(h, self.lora_B.weight) * shape.scaling

    def _expert_lora_delta(self, x: torch.Tensor, mappings) -> torch.Tensor:
        """An expert's share, without communication, as its base: the dispatcher gives every rank of the expert-TP
        group the same tokens and sums their outputs (and their input gradients). The factor each of them holds
        whole then gets a gradient from its own part of the product: summed over the group (all-reduced in
        backward, copy_to's), so that the copies stay one."""
        a, b = self.lora_A.weight, self.lora_B.weight
        if self.tp_group is not None and self.tp_group.size() > 1:
            if self.lora_kind == "column":
                a = mappings.copy_to_tensor_model_parallel_region(a, group=self.tp_group)
            else:
                b = mappings.copy_to_tensor_model_parallel_region(b, group=self.tp_group)
        return F.linear(F.linear(x, a), b) * self.lora_shape.scaling

    def _lora_dropout(self, x: torch.Tensor) -> torch.Tensor:
        p = self.lora_shape.dropout
        if not p or not self.training:
            return x
        # a rank's own inputs (its tokens, its columns) draw their own masks; the whole input of a column-parallel
        # base draws the same mask on every rank, or the ranks' copies of A would part
        if self.lora_kind == "row" or self.sequence_parallel:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.dropout(x, p, training=True)
        return F.dropout(x, p, training=True)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base's entries (its own names and splits) and the factors': the split one on its split axis."""
        from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

        entries = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        name, axis = (LORA_B, 0) if self.lora_kind == "column" else (LORA_A, 1)
        key = f"{prefix}{name}.weight"
        groups = {"tp_group": self.tp_group, "dp_cp_group": (metadata or {}).get("dp_cp_group")}
        entry = make_tp_sharded_tensor_for_checkpoint(getattr(self, name).weight, key, axis,
                                                      prepend_offsets=sharded_offsets, **groups)
        if self.lora_shape.gated:
            entry = _swiglu_entry(entry, sharded_offsets, metadata, self.tp_group)
        entries[key] = entry
        return entries


def _swiglu_entry(entry, sharded_offsets, metadata, tp_group):
    """megatron's gated-fc1 checkpoint entry ([gate; up], each split over the linear's group) for a factor, with the
    arguments the installed release's apply_swiglu_sharded_factory takes (0.19 names the groups: an expert's)."""
    import inspect

    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    taken = inspect.signature(apply_swiglu_sharded_factory).parameters
    options = {"singleton_local_shards": (metadata or {}).get("singleton_local_shards", False)}
    if "tp_group" in taken:
        options.update(tp_group=tp_group, dp_group=(metadata or {}).get("dp_cp_group"))
    return apply_swiglu_sharded_factory(entry, sharded_offsets, **options)
