"""--use-coc: tensor-parallel linears whose collective runs chunk by chunk while other chunks are multiplied.

Chunks are ranges of each rank's sequence rows (uneven when the rows do not divide). A chunk of the gathered
sequence holds the same row range of every rank, so each collective is Megatron's own on a smaller tensor and
every output row lands where Megatron puts it. Every GEMM row sees the same operands as Megatron's, and the weight
gradient is one GEMM over the same rows in the same order, so the only arithmetic that could differ is a reduction
over ranks: a sum of two values (TP2) is the same in any order.

Three layers, each importing only the one before:
- coc_chunks: the chunk plan (Rows) and each chunk's asynchronous collective;
- coc_autograd: AllGatherMatmul and MatmulReduce, the linears' matmuls around those collectives;
- this module, the Megatron glue: ChunkedLinears, one per application of the feature, whose methods wrap
  megatron's linears and which holds what the wrappers share (the calls counted, the expert running now)."""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from dataclasses import dataclass

import torch

from mm_adaptor.patches.tensor_parallel.coc_autograd import AllGatherMatmul, MatmulReduce  # noqa: F401
from mm_adaptor.patches.tensor_parallel.coc_chunks import Rows, chunk_bounds  # noqa: F401  (callers read them here)

_SIGNATURES: dict = {}


def _bind(function, args, kwargs) -> dict:
    """The arguments of megatron's linear function by name, as the installed release names and orders them
    (0.17 dropped async_grad_allreduce, whose position tp_group took; 0.19 added gtp_remat_size)."""
    signature = _SIGNATURES.get(function)
    if signature is None:
        signature = _SIGNATURES[function] = inspect.signature(function)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _gtp_sharded(size) -> bool:
    """megatron 0.19's GTP weight rematerialisation: the weight is a shard gathered inside megatron's own
    autograd function, which the chunked paths do not do (a release without GTP passes None or 1)."""
    return (size or 1) > 1


def _group_or_default(tp_group):
    from megatron.core.parallel_state import get_tensor_model_parallel_group

    return tp_group if tp_group is not None else get_tensor_model_parallel_group()


def _input_of(args, kwargs):
    return args[0] if args else kwargs["input_"]


@dataclass(frozen=True)
class ExpertRows:
    """While an expert runs under chunked expert-TP collectives: its rows per expert-TP rank, and the dtype
    megatron's combine reduces in."""

    counts: tuple
    reduce_dtype: torch.dtype


class ChunkedLinears:
    """The wrappers one application of --use-coc patches into megatron's tensor-parallel linears, splitting their
    collectives into `chunks`, and what they share: `calls` counts the forward calls that went by chunks per kind
    of linear (the feature's statistics; pass a Counter to keep counting across applications), `expert` is the
    expert running inside expert_collectives, `trace` a list receiving the chunks' events, or None."""

    def __init__(self, chunks: int, calls: Counter | None = None, trace: list | None = None):
        self.chunks = chunks
        self.calls = Counter() if calls is None else calls
        self.trace = trace
        self.expert: ExpertRows | None = None

    @contextlib.contextmanager
    def expert_collectives(self, counts, reduce_dtype):
        """Within: an expert's fc1 gathers its rows from the expert-TP ranks and its fc2 reduce-scatters them
        back."""
        saved, self.expert = self.expert, ExpertRows(tuple(counts), reduce_dtype)
        try:
            yield
        finally:
            self.expert = saved

    def linear_under_sequence_parallel(self, wrapped, instance, args, kwargs):
        """Wrapper of megatron's linear_with_grad_accumulation_and_async_allreduce: its sequence-parallel
        all-gather (column-parallel linears) goes by chunks; every other use runs megatron's."""
        bound = _bind(wrapped, args, kwargs)
        group = None
        if (bound.get("sequence_parallel") and not bound.get("grad_output_buffer") and self.chunks > 1
                and not _gtp_sharded(bound.get("gtp_remat_size"))):
            group = _group_or_default(bound.get("tp_group"))
        if group is None or group.size() == 1:
            return wrapped(*args, **kwargs)
        self.calls["column-parallel all-gather"] += 1
        return AllGatherMatmul.apply(bound["input"], bound["weight"], bound["bias"],
                                     bound["gradient_accumulation_fusion"], self.chunks, group, None, self.trace)

    def column_parallel_expert_forward(self, wrapped, instance, args, kwargs):
        """Wrapper of ColumnParallelLinear.forward: an expert's fc1 inside expert_collectives gathers its rows
        (coc_experts has checked that it can: a trainable weight, not GTP-sharded)."""
        if self.expert is None or not instance.explicit_expert_comm:
            return wrapped(*args, **kwargs)
        bias = instance.bias if not instance.skip_bias_add else None
        self.calls["expert fc1 all-gather"] += 1
        output = AllGatherMatmul.apply(_input_of(args, kwargs), instance.weight, bias,
                                       instance.gradient_accumulation_fusion, self.chunks, instance.tp_group,
                                       self.expert.counts, self.trace)
        return output, (instance.bias if instance.skip_bias_add else None)

    def row_parallel_forward(self, wrapped, instance, args, kwargs):
        """Wrapper of RowParallelLinear.forward: its matmul and reduce-scatter (or all-reduce) go by chunks where
        megatron would run them itself (input already split, a trainable weight, no expert or offloading path)."""
        input_, group, chunks = _input_of(args, kwargs), instance.tp_group, self.chunks
        if self.expert is not None and instance.explicit_expert_comm:  # an expert's fc2: its rows go back
            self.calls["expert fc2 reduce-scatter"] += 1
            output_ = MatmulReduce.apply(input_, instance.weight, instance.gradient_accumulation_fusion, True, chunks,
                                         group, self.expert.counts, self.expert.reduce_dtype, self.trace)
            return output_, instance.bias
        if (chunks == 1 or group is None or group.size() == 1 or not instance.input_is_parallel
                or instance.explicit_expert_comm or instance.config._cpu_offloading_context is not None
                or not instance.weight.requires_grad or _gtp_sharded(getattr(instance, "gtp_remat_size", 1))):
            return wrapped(*args, **kwargs)
        self.calls["row-parallel reduce-scatter" if instance.sequence_parallel else "row-parallel all-reduce"] += 1
        output_ = MatmulReduce.apply(input_, instance.weight, instance.gradient_accumulation_fusion,
                                     instance.sequence_parallel, chunks, group, None, None, self.trace)
        if not instance.skip_bias_add:
            output = (output_ + instance.bias) if instance.bias is not None else output_
            return output, None
        return output_, instance.bias
