"""gloo's gaps that megatron runs into on the CPU backend, filled before the shared redirection sees the call:
asynchronous sends take a copy of their tensor (megatron frees a pipeline output while gloo's background thread may
still read it), and the collectives gloo lacks for uneven sizes (list all_gather, list reduce_scatter), which
megatron's MoE uses under expert tensor parallelism, run as padded tensor collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mm_adaptor.core.patching import bound_arguments


class _Completed:
    """The work handle of a collective that already ran."""

    @staticmethod
    def wait(timeout=None):
        return True

    @staticmethod
    def is_completed():
        return True


def _on_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def _all_gather_uneven(func, args, kwargs):
    """gloo's all_gather takes equal sizes only; megatron's MoE gathers uneven ones (expert tensor parallelism):
    each rank's part is padded to the widest, gathered in one all_gather_into_tensor and cut back."""
    bound = bound_arguments(("tensor_list", "tensor", "group", "async_op"), args, kwargs)
    outputs, tensor, group = bound["tensor_list"], bound["tensor"], bound.get("group")
    if all(out.shape == tensor.shape for out in outputs) or not _on_gloo(group):
        return func(*args, **kwargs)
    widest = max(out.shape[0] for out in outputs)
    padded = tensor.new_zeros((widest, *tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    gathered = tensor.new_empty((len(outputs) * widest, *tensor.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    for rank, out in enumerate(outputs):
        out.copy_(gathered[rank * widest:rank * widest + out.shape[0]])
    return _Completed() if bound.get("async_op") else None


def _reduce_scatter_list(func, args, kwargs):
    """gloo has no list reduce_scatter (megatron's MoE uses it for uneven sizes): the parts are padded to the
    widest and reduce-scattered as one tensor."""
    bound = bound_arguments(("output", "input_list", "op", "group", "async_op"), args, kwargs)
    output, parts, group = bound["output"], bound["input_list"], bound.get("group")
    if not _on_gloo(group):
        return func(*args, **kwargs)
    widest = max(part.shape[0] for part in parts)
    padded = output.new_zeros((len(parts) * widest, *output.shape[1:]))
    for rank, part in enumerate(parts):
        padded[rank * widest:rank * widest + part.shape[0]] = part
    mine = output.new_empty((widest, *output.shape[1:]))
    dist.reduce_scatter_tensor(mine, padded, op=bound.get("op", dist.ReduceOp.SUM), group=group)
    output.copy_(mine[:output.shape[0]])
    return _Completed() if bound.get("async_op") else None


def _isend_a_copy(func, args, kwargs):
    """An asynchronous gloo send reads its tensor from a background thread until its work completes, but megatron
    frees a pipeline output right after issuing its send (deallocate_output_tensor swaps the storage out, which
    NCCL's stream ordering tolerates): the send gets a copy of its own."""
    if args:
        args = (args[0].detach().clone(), *args[1:])
    else:
        kwargs = dict(kwargs, tensor=kwargs["tensor"].detach().clone())
    return func(*args, **kwargs)


# gloo's gaps megatron runs into, handled before the shared redirection (CPU backend only).
GLOO_SPECIALS = {
    torch.distributed.isend: _isend_a_copy,
    torch.distributed.all_gather: _all_gather_uneven,
    torch.distributed.reduce_scatter: _reduce_scatter_list,
}
