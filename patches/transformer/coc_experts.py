"""--use-coc for tensor-parallel experts (expert tensor parallel size > 1, the all-to-all dispatcher, SequentialMLP
without --moe-grouped-gemm).

Megatron gathers every expert-TP rank's tokens (one all-gather), sorts them by local expert, runs each expert on
its rows and reduce-scatters the result (one reduce-scatter). Here each rank sorts its own tokens by local expert
instead, and each expert's fc1 gathers that expert's rows from the expert-TP ranks chunk by chunk, multiplying
each chunk while the next is in flight, and its fc2 reduce-scatters them back chunk by chunk
(patches/tensor_parallel/coc*.py, with the uneven row counts the router produced). Rank r's rows of expert e are
the same rows in the same order as in megatron's sorted gather (rank-major, then source EP rank), so every expert
sees megatron's rows; the routing probabilities take megatron's own gather and sort."""

from __future__ import annotations

import torch

from mm_adaptor.patches.tensor_parallel.coc import ChunkedLinears


def _eligible(layer, chunks: int) -> bool:
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    dispatcher, config = layer.token_dispatcher, layer.config
    # the inference dispatchers megatron 0.17+ switches to under InferenceMode gather, not all-to-all: not eligible
    return (chunks > 1 and isinstance(dispatcher, MoEAlltoAllTokenDispatcher) and dispatcher.tp_size > 1
            and isinstance(layer.experts, SequentialMLP) and not dispatcher.drop_and_pad
            and dispatcher.shared_experts is None and not config.moe_apply_probs_on_input
            and not config.add_bias_linear and not (config.fp8 or getattr(config, "fp4", None))
            # --moe-grouped-gemm: GroupedMLP up to 0.16 (not eligible); from 0.17 a SequentialMLP whose forward
            # --use-fused-gmm runs as grouped GEMMs, which this path would bypass: megatron's collectives, as on 0.16
            and not config.moe_grouped_gemm
            # 0.18+: an autograd hook on the experts' input (CUDA events for the delayed weight gradient)
            and not getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False)
            # 0.19+: a dispatcher whose experts write into its communication buffers
            and _zero_copy_buffers(dispatcher) == (None, None)
            and config._cpu_offloading_context is None
            and all(_chunkable(linear) for expert in layer.experts.local_experts
                    for linear in (expert.linear_fc1, expert.linear_fc2)))


def _zero_copy_buffers(dispatcher):
    buffers = getattr(dispatcher, "get_expert_zero_copy_buffers", None)
    return tuple(buffers()) if buffers is not None else (None, None)


def _chunkable(linear) -> bool:
    """An expert linear whose matmul the chunked path may run: megatron's own (local spec), a trainable weight,
    not GTP-sharded (megatron 0.19's weight rematerialisation)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return (isinstance(linear, (ColumnParallelLinear, RowParallelLinear)) and linear.weight is not None
            and linear.weight.requires_grad and (getattr(linear, "gtp_remat_size", 1) or 1) == 1)


def _local_sort(num_local_experts: int, ep: int):
    """Indices that put chunks ordered (source EP rank, expert) in the order (expert, source EP rank); and back."""
    forward = torch.arange(ep * num_local_experts).reshape(ep, num_local_experts).T.ravel()
    backward = torch.arange(num_local_experts * ep).reshape(num_local_experts, ep).T.ravel()
    return forward, backward


def routed_experts_compute_chunked(linears: ChunkedLinears):
    """Wrapper of MoELayer.routed_experts_compute (dispatch_postprocess, experts, combine_preprocess); each
    expert's linears go by chunks through `linears`, the same application's column- and row-parallel wrappers."""

    def wrapper(wrapped, instance, args, kwargs):
        if not _eligible(instance, linears.chunks):
            return wrapped(*args, **kwargs)
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
        from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

        hidden_states, probs = _hidden_states_and_probs(args, kwargs)
        d = instance.token_dispatcher
        tp, ep, experts = d.tp_size, d.ep_size, d.num_local_experts
        splits_tp = d.output_splits_tp.tolist()
        all_probs = gather_from_sequence_parallel_region(probs, group=d.tp_group, output_split_sizes=splits_tp)
        d.tokens_per_expert = d._maybe_dtoh_and_synchronize("before_permutation_2", d.tokens_per_expert)
        if experts > 1:
            per_source = d.num_global_tokens_per_local_expert  # [tp x ep, experts]
            all_probs, _ = sort_chunks_by_idxs(all_probs, per_source.ravel(), d.sort_input_by_local_experts)
            counts = per_source.reshape(tp, ep, experts).tolist()
            rows = [[sum(counts[t][s][e] for s in range(ep)) for t in range(tp)] for e in range(experts)]
            to_experts, back = _local_sort(experts, ep)
            mine = per_source.reshape(tp, ep, experts)[d.tp_rank]
            tokens, _ = sort_chunks_by_idxs(hidden_states, mine.ravel(), to_experts)
        else:
            rows, tokens = [splits_tp], hidden_states
        d._maybe_dtoh_and_synchronize("before_finish", d.tokens_per_expert)
        d.tokens_per_expert = None

        outputs, local_at, gathered_at = [], 0, 0
        for expert, expert_rows in zip(instance.experts.local_experts, rows):
            own, total = expert_rows[d.tp_rank], sum(expert_rows)
            with linears.expert_collectives(expert_rows, d.probs.dtype):
                output, _bias = expert(tokens[local_at:local_at + own], all_probs[gathered_at:gathered_at + total])
            outputs.append(output)
            local_at, gathered_at = local_at + own, gathered_at + total
        output = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        if experts > 1:
            output, _ = sort_chunks_by_idxs(output, mine.T.ravel(), back)
        return output, None

    return wrapper


def _hidden_states_and_probs(args, kwargs):
    values = list(args) + [kwargs[name] for name in ("hidden_states", "probs") if name in kwargs]
    return values[0], values[1]
