"""Megatron modules rerouted to the native ops (mm_adaptor.ops): RMSNorm, SwiGLU, rotary embeddings."""

from __future__ import annotations

import warnings

import torch

from mm_adaptor import ops


class FusedRMSNorm(torch.nn.Module):
    """RMSNorm on the native kernel; same parameter name and shape as torch.nn.RMSNorm (checkpoints match)."""

    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        # Under sequence parallelism each TP rank sees a sequence shard: megatron all-reduces the
        # gradients of parameters marked like this across the TP group.
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, kernel=mm_adaptor::rms_norm"


def torch_norm_new_with_fused_rmsnorm(wrapped, instance, args, kwargs):
    """WrappedTorchNorm(config, hidden_size, eps, ...) -> FusedRMSNorm when config.normalization is RMSNorm."""
    names = ("cls", "config", "hidden_size", "eps")
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    config = bound["config"]
    if config.normalization != "RMSNorm":
        return wrapped(*args, **kwargs)
    return FusedRMSNorm(bound["hidden_size"], bound.get("eps", 1e-5), bool(config.sequence_parallel),
                        dtype=config.params_dtype)


def _is_plain_swiglu(config, activation_func) -> bool:
    import torch.nn.functional as F

    return (config.gated_linear_unit and activation_func is F.silu and not config.use_te_activation_func
            and config.activation_func_clamp_value is None and not config.glu_linear_offset)


def mlp_forward_with_fused_swiglu(wrapped, instance, args, kwargs):
    """MLP.forward with fc1 -> (+bias) -> mm_adaptor::swiglu [-> x routing probs] -> fc2; other activations run
    megatron's code. The probability scale (MoE experts of SequentialMLP) is applied as megatron's unfused path does."""
    if instance is None:  # called through the class: MLP.forward(mlp, ...)
        instance, args = args[0], args[1:]
    if not _is_plain_swiglu(instance.config, instance.activation_func):
        return wrapped(*args, **kwargs)
    hidden_states = args[0] if args else kwargs["hidden_states"]
    per_token_scale = args[1] if len(args) > 1 else kwargs.get("per_token_scale")
    intermediate, bias = instance.linear_fc1(hidden_states)
    if bias is not None:
        intermediate = intermediate + bias
    intermediate = ops.swiglu(intermediate)
    if per_token_scale is not None:
        intermediate = (intermediate * per_token_scale.unsqueeze(-1)).to(intermediate.dtype)
    output, output_bias = instance.linear_fc2(intermediate)
    if per_token_scale is not None and output_bias is not None:  # an expert adds its scaled bias itself
        # megatron adds in place: the sum is formed in the probabilities' dtype and stored in the output's
        output = (output + output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)).to(output.dtype)
        output_bias = None
    return output, output_bias


def grouped_mlp_init_with_fused_swiglu(wrapped, instance, args, kwargs):
    """GroupedMLP built with its SwiGLU on mm_adaptor::swiglu (its probability scale reads self.activation_func)."""
    wrapped(*args, **kwargs)
    if _is_plain_swiglu(instance.config, instance.config.activation_func):
        instance.activation_func = ops.swiglu


_warned_rope_fallback = False


def apply_rotary_pos_emb_fused(wrapped, instance, args, kwargs):
    """apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, ...) on the native kernel for the
    [s, b, h, d] layout; packed sequences, multi-latent attention, mscale != 1 and mRoPE keep megatron's code."""
    names = ("t", "freqs", "config", "cu_seqlens", "mscale")
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    config = bound["config"]
    unsupported = [reason for reason, present in (
        ("packed sequences (cu_seqlens)", bound.get("cu_seqlens") is not None),
        ("multi-latent attention", getattr(config, "multi_latent_attention", False)),
        ("mscale != 1", bound.get("mscale", 1.0) != 1.0),
        ("mRoPE", getattr(config, "mrope_section", None) is not None),
    ) if present]
    if unsupported:
        global _warned_rope_fallback
        if not _warned_rope_fallback:
            _warned_rope_fallback = True
            warnings.warn(f"--use-fused-rotary-pos-emb: {', '.join(unsupported)} not covered by the native kernel; "
                          "megatron's implementation runs for these calls", RuntimeWarning, stacklevel=2)
        return wrapped(*args, **kwargs)
    return ops.rotary_pos_emb(bound["t"], bound["freqs"], bool(config.rotary_interleaved))


def _flash_attention_applies(attn, attention_bias, packed_seq_params) -> str | None:
    """None when the native path computes exactly what megatron's DotProductAttention computes, else why not."""
    config = attn.config
    if packed_seq_params is not None:
        return "packed sequences"
    if attention_bias is not None:
        return "attention bias"
    if getattr(attn, "softmax_offset", None) is not None:
        return "softmax offset"
    if config.apply_query_key_layer_scaling:
        return "query-key layer scaling"
    if attn.training and config.attention_dropout > 0:
        return "attention dropout"
    return None


_warned_attention_fallback = False


def dot_product_attention_forward_flash(wrapped, instance, args, kwargs):
    """DotProductAttention.forward on mm_adaptor.ops.flash_attention (PyTorch's fused kernels: no s x s
    scores kept for backward). Returns [sq, b, hp] like megatron."""
    from megatron.core.transformer.enums import AttnMaskType

    if instance is None:
        instance, args = args[0], args[1:]
    names = ("query", "key", "value", "attention_mask", "attn_mask_type", "attention_bias", "packed_seq_params")
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    why_not = _flash_attention_applies(instance, bound.get("attention_bias"), bound.get("packed_seq_params"))
    if why_not:
        global _warned_attention_fallback
        if not _warned_attention_fallback:
            _warned_attention_fallback = True
            warnings.warn(f"--use-flash-attn: {why_not} is not covered; megatron's attention runs for these calls",
                          RuntimeWarning, stacklevel=2)
        return wrapped(*args, **kwargs)
    query, key, value = bound["query"], bound["key"], bound["value"]
    mask = bound.get("attention_mask")
    # Megatron applies a given mask as it is; only without one does the causal mask type build the causal mask.
    causal = mask is None and instance.attn_mask_type == AttnMaskType.causal and query.shape[0] > 1
    context = ops.flash_attention(query, key, value, causal=causal, attention_mask=mask,
                                  scale=instance.softmax_scale)
    return context.reshape(context.shape[0], context.shape[1], -1)
