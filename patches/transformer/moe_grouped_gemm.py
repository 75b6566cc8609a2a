"""Megatron's GroupedMLP (--moe-grouped-gemm) on the native grouped_matmul instead of the grouped_gemm package."""

from __future__ import annotations

import types

import torch

from mm_adaptor import ops
from mm_adaptor.ops.grouped_matmul import placed_counts
from mm_adaptor.core.patching import bound_arguments


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """The grouped_gemm package's `ops.gmm` signature: rows of `a` grouped by batch_sizes, times b[e] (or b[e].T)."""
    return ops.grouped_matmul(a, b.transpose(1, 2) if trans_b else b, batch_sizes)


NATIVE_GROUPED_GEMM_OPS = types.SimpleNamespace(gmm=gmm)


PROBS_ON_INPUT_REFUSAL = ("--moe-apply-probs-on-input works only with --moe-router-topk 1 (megatron's GroupedMLP "
                          "refuses it too): set --moe-router-topk 1 or drop --moe-apply-probs-on-input")


def grouped_gemm_is_available() -> bool:
    return True


def grouped_mlp_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
    """GroupedMLP.forward for every dtype (megatron's asserts bf16, a limit of the grouped_gemm package); otherwise
    megatron's steps: probabilities on the input, moe_act recompute (which megatron's own forward can only run with
    Transformer Engine installed), its activation (which, like megatron's, ignores the clamp value and the GLU
    offset). fp8 plays no part in megatron's GroupedMLP either.

    Zero tokens need no special case: grouped_matmul of zero rows gives zero weight gradients."""
    config = self.config
    hidden, probs = permuted_local_hidden_states, permuted_probs
    if config.moe_apply_probs_on_input:
        if config.moe_router_topk != 1:
            from mm_adaptor.core.features import FeatureConfigError

            raise FeatureConfigError(PROBS_ON_INPUT_REFUSAL)
        hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
        probs = torch.ones_like(probs)
    w1 = self.weight1.view(self.num_local_experts, config.hidden_size, -1)
    w2 = self.weight2.view(self.num_local_experts, -1, config.hidden_size)
    fc1_output = gmm(hidden, w1, tokens_per_expert)
    probs = probs.unsqueeze(-1)
    if self.activation_recompute:
        from megatron.core import tensor_parallel

        # fp8=None: megatron's default (False) reads as fp8 on and reaches Transformer Engine's FP8 state, a
        # NameError without TE; GroupedMLP refuses fp8 with moe_act recompute anyway
        self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=None)
        intermediate = self.activation_checkpoint.checkpoint(self.activation_func_with_probs, fc1_output, probs)
        output = gmm(intermediate, w2, tokens_per_expert)
        self.activation_checkpoint.discard_output_and_register_recompute(output)
    else:
        output = gmm(self.activation_func_with_probs(fc1_output, probs), w2, tokens_per_expert)
    return output, None


# megatron-core 0.17+ -----------------------------------------------------------------------------------------------
# 0.17 removed GroupedMLP and grouped_gemm_util: with the local spec, --moe-grouped-gemm builds SequentialMLP, which
# runs its local experts one after the other (one F.linear pair per expert). Here such a SequentialMLP runs its
# experts as megatron's MLP.forward once, over all local experts' rows, with fc1 and fc2 each one grouped_matmul.
# The experts keep their own Linear modules and parameters (same checkpoints); the stacked weights exist only for
# the duration of each GEMM (forward and backward restack them, nothing stacked is kept for backward).


class GroupedExpertLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ W_e^T for the per-expert Linear weights W_e ([out, in]), one grouped_matmul;
    backward gives each W_e its gradient (one grouped_matmul_bwd)."""

    @staticmethod
    def forward(ctx, x, tokens_per_expert, *weights):
        from mm_adaptor.ops.grouped_matmul import check_counts
        from mm_adaptor.ops.library import ensure, op

        ensure(x.device.type)
        check_counts(tokens_per_expert, len(weights), x.shape[0])
        ctx.save_for_backward(x, tokens_per_expert, *weights)
        return op("grouped_matmul_fwd")(x, torch.stack(weights).transpose(1, 2), tokens_per_expert)

    @staticmethod
    def backward(ctx, dy):
        from mm_adaptor.ops.library import op

        x, tokens_per_expert, *weights = ctx.saved_tensors
        dx, dw = op("grouped_matmul_bwd")(dy.contiguous(), x, torch.stack(weights).transpose(1, 2),
                                          tokens_per_expert)
        return (dx, None, *dw.transpose(1, 2).unbind(0))


class GroupedExpertLinears(torch.nn.Module):
    """Stands in for one expert's linear_fc1 (or linear_fc2) while megatron's MLP.forward runs over every local
    expert's rows: the rows of expert e go through expert e's weight. Holds no parameters of its own."""

    def __init__(self, weights, tokens_per_expert, stats, function=None):
        super().__init__()
        self.weights, self.tokens_per_expert, self.stats = tuple(weights), tokens_per_expert, stats
        self.function = function or GroupedExpertLinear

    def forward(self, x, *_args, **_kwargs):
        self.stats["grouped_matmul calls"] += 1
        rows = x.reshape(-1, x.shape[-1])
        y = self.function.apply(rows, self.tokens_per_expert, *self.weights)
        return y.view(*x.shape[:-1], y.shape[-1]), None


_warned: set[str] = set()


def _warn_megatron_loop(why: str) -> None:
    if why not in _warned:
        _warned.add(why)
        import warnings

        warnings.warn(f"--use-fused-gmm: {why}; megatron's SequentialMLP runs its experts one by one for these "
                      "layers", RuntimeWarning, stacklevel=3)


def _plain_expert_linear(linear, kind) -> str | None:
    """Why megatron's linear does more than x @ W^T here (None: it does just that)."""
    from megatron.core.utils import get_pg_size

    if type(linear) is not kind:
        return f"an expert linear of type {type(linear).__name__} (not megatron's {kind.__name__})"
    if getattr(linear, "bias", None) is not None:
        return "expert biases"
    weight = getattr(linear, "weight", None)
    if weight is None or not weight.requires_grad:
        return "frozen or absent expert weights"
    if (getattr(linear, "gtp_remat_size", 1) or 1) != 1:
        return "GTP weight rematerialisation"
    if not linear.explicit_expert_comm and get_pg_size(linear.tp_group) != 1:
        return "expert linears that communicate themselves"
    if linear._forward_hooks or linear._forward_pre_hooks:
        return "forward hooks on the expert linears"
    return None


def megatron_loop_needed(experts) -> str | None:
    """Why this SequentialMLP must run megatron's own per-expert loop, or None when the grouped path computes what
    megatron's would: plain local-spec experts whose fc1/fc2 are bare matmuls (the token dispatcher does the
    expert communication), no quantization, offloading or delayed weight gradients, and no module hooks."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP

    config = experts.config
    if config.fp8 or getattr(config, "fp4", None):
        return "fp8/fp4 experts (megatron pads each expert's rows)"
    if getattr(config, "_cpu_offloading_context", None) is not None:
        return "activation CPU offloading"
    if getattr(config, "delay_wgrad_compute", False):
        return "delayed weight gradients (backward_dw)"
    for expert in experts.local_experts:
        if type(expert) is not MLP:
            return f"experts of type {type(expert).__name__}"
        if expert._forward_hooks or expert._forward_pre_hooks:
            return "forward hooks on the experts"
        for linear, kind in ((expert.linear_fc1, ColumnParallelLinear), (expert.linear_fc2, RowParallelLinear)):
            why = _plain_expert_linear(linear, kind)
            if why:
                return why
    return None


def sequential_mlp_forward_grouped(stats, function=None):
    """Wrapper of SequentialMLP.forward (megatron-core 0.17+; inert where --moe-grouped-gemm builds GroupedMLP):
    with --moe-grouped-gemm, megatron's MLP.forward of the first local expert runs once over every local expert's
    rows, its linear_fc1 and linear_fc2 stood in for by grouped_matmuls over all local experts' weights. The
    activation and the routing-probability scale are megatron's code (and whatever wraps MLP.forward, e.g.
    --use-fused-swiglu or --recompute-activation-function on that expert), applied row-wise to every expert's rows
    at once, as they are the same for every expert. `stats` counts what ran; `function` is the autograd function
    of the grouped linears (GroupedExpertLinear unless given: the broken variant's tests pass a wrong one)."""

    def wrapper(wrapped, instance, args, kwargs):
        if instance is None or not instance.config.moe_grouped_gemm:
            return wrapped(*args, **kwargs)
        why = megatron_loop_needed(instance)
        if why:
            _warn_megatron_loop(why)
            stats["SequentialMLP forwards on megatron's loop"] += 1
            return wrapped(*args, **kwargs)
        bound = bound_arguments(("permuted_local_hidden_states", "tokens_per_expert", "permuted_probs"), args, kwargs)
        hidden, probs = bound["permuted_local_hidden_states"], bound["permuted_probs"]
        counts = bound["tokens_per_expert"]
        counts = placed_counts(hidden, counts)
        config = instance.config
        if config.moe_apply_probs_on_input:  # as megatron's SequentialMLP: scale the input, then probabilities 1
            if config.moe_router_topk != 1:
                from mm_adaptor.core.features import FeatureConfigError

                raise FeatureConfigError(PROBS_ON_INPUT_REFUSAL)
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        experts = instance.local_experts
        first = experts[0]
        modules = first._modules
        saved = modules["linear_fc1"], modules["linear_fc2"]
        modules["linear_fc1"] = GroupedExpertLinears([e.linear_fc1.weight for e in experts], counts, stats,
                                                     function)
        modules["linear_fc2"] = GroupedExpertLinears([e.linear_fc2.weight for e in experts], counts, stats,
                                                     function)
        try:
            output, output_bias = first(hidden, probs)
        finally:
            modules["linear_fc1"], modules["linear_fc2"] = saved
        stats["SequentialMLP forwards as grouped GEMMs"] += 1
        return output, output_bias

    return wrapper
