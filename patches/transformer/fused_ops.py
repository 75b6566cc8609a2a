"""Megatron modules rerouted to the native ops (mm_adaptor.ops): RMSNorm, SwiGLU, rotary embeddings, core attention."""

from __future__ import annotations

import warnings

import torch

from mm_adaptor import ops
from mm_adaptor.core.patching import bound_arguments


_warned: set[tuple[str, str]] = set()


def _warn_fallback(flag: str, what: str) -> None:
    """One warning per flag and reason: megatron's own code runs for the calls that need `what`."""
    if (flag, what) in _warned:
        return
    _warned.add((flag, what))
    warnings.warn(f"{flag}: {what} is not covered by the native kernel; megatron's own code runs for these calls",
                  RuntimeWarning, stacklevel=3)


class FusedRMSNorm(torch.nn.Module):
    """RMSNorm on the native kernel; same parameter name and shape as torch.nn.RMSNorm (checkpoints match).

    zero_centered_gamma (--apply-layernorm-1p): the weight starts at zeros and y = x_hat * (1 + w), as in
    Transformer Engine's and Apex's norms; 1 + w is formed in fp32 (at least), as Transformer Engine does."""

    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool, zero_centered_gamma: bool = False,
                 dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype, device=device))
        # Under sequence parallelism each TP rank sees a sequence shard: megatron all-reduces the
        # gradients of parameters marked like this across the TP group.
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x):
        weight = self.weight
        if self.zero_centered_gamma:
            weight = weight.to(torch.promote_types(weight.dtype, torch.float32)) + 1
        return ops.rms_norm(x, weight, self.eps)

    def extra_repr(self) -> str:
        centred = ", zero_centered_gamma=True" if self.zero_centered_gamma else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{centred}, kernel=mm_adaptor::rms_norm"


MEMORY_EFFICIENT_NORM_REFUSAL = (
    "--use-fused-rmsnorm does not implement --memory-efficient-layer-norm (Apex's norm that keeps its output instead "
    "of its input for backward; megatron's torch norm refuses it too): drop --memory-efficient-layer-norm")


def torch_norm_new_with_fused_rmsnorm(wrapped, instance, args, kwargs):
    """WrappedTorchNorm(config, hidden_size, eps, ...) -> FusedRMSNorm when config.normalization is RMSNorm.

    persist_layer_norm only selects Apex's persistent LayerNorm kernel: no meaning here, accepted."""
    names = ("cls", "config", "hidden_size", "eps")
    bound = bound_arguments(names, args, kwargs, named_only=True)
    config = bound["config"]
    if config.normalization != "RMSNorm":
        return wrapped(*args, **kwargs)
    if config.memory_efficient_layer_norm:
        from mm_adaptor.core.features import FeatureConfigError

        raise FeatureConfigError(MEMORY_EFFICIENT_NORM_REFUSAL)
    return FusedRMSNorm(bound["hidden_size"], bound.get("eps", 1e-5), bool(config.sequence_parallel),
                        zero_centered_gamma=bool(config.layernorm_zero_centered_gamma), dtype=config.params_dtype)


def _is_swiglu(config, activation_func) -> bool:
    import torch.nn.functional as F

    return bool(config.gated_linear_unit) and activation_func is F.silu


def _swiglu_needs_megatron(config, per_token_scale) -> str | None:
    """Why MLP.forward's SwiGLU must run megatron's code for this call, or None when the native op computes what
    megatron computes (its fused path ignores the clamp value and the GLU offset, its unfused path applies them)."""
    from megatron.core.transformer import mlp

    if config.use_te_activation_func:
        return "Transformer Engine's activation module (use_te_activation_func)"
    if config.bias_activation_fusion:
        if per_token_scale is not None and config.add_bias_linear:
            return "routing-probability scale with a bias under --bias-swiglu-fusion (megatron refuses it)"
        if config.activation_func_fp8_input_store:
            return "--activation-func-fp8-input-store (the fused SwiGLU keeps its input in fp8 for backward)"
        if config.cpu_offloading and config.cpu_offloading_activations and mlp.HAVE_TE:
            return "activation CPU offloading (the fused SwiGLU marks its input for Transformer Engine's offloading)"
        return None
    if config.activation_func_clamp_value is not None:
        return "activation_func_clamp_value"
    if config.glu_linear_offset:
        return "glu_linear_offset"
    return None


def mlp_forward_with_fused_swiglu(wrapped, instance, args, kwargs):
    """MLP.forward with fc1 -> (+bias) -> mm_adaptor::swiglu [-> x routing probs] -> fc2; other activations run
    megatron's code. The probability scale (MoE experts of SequentialMLP) is applied as megatron's unfused path does."""
    if instance is None:  # called through the class: MLP.forward(mlp, ...)
        instance, args = args[0], args[1:]
    if not _is_swiglu(instance.config, instance.config.activation_func):
        return wrapped(*args, **kwargs)
    hidden_states = args[0] if args else kwargs["hidden_states"]
    per_token_scale = args[1] if len(args) > 1 else kwargs.get("per_token_scale")
    why_not = _swiglu_needs_megatron(instance.config, per_token_scale)
    if why_not:
        _warn_fallback("--use-fused-swiglu", why_not)
        return wrapped(*args, **kwargs)
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
    """GroupedMLP built with its SwiGLU on mm_adaptor::swiglu (its probability scale reads self.activation_func).
    Megatron's GroupedMLP ignores the clamp value, the GLU offset and TE's activation module: so does this."""
    wrapped(*args, **kwargs)
    if _is_swiglu(instance.config, instance.config.activation_func):
        instance.activation_func = ops.swiglu


def _rope_needs_megatron(t, freqs, config, cu_seqlens, mscale, mla_rotary_interleaved=False) -> str | None:
    """Why apply_rotary_pos_emb must run megatron's code for this call, or None when the native kernel computes
    megatron's rotation ([s, b, h, d], one angle set per position; cp_group plays no part in that layout).
    mla_rotary_interleaved: megatron-core 0.19's argument (None reads the config's MLA switch); True asks for the
    MLA de-interleaving whatever the config says."""
    if cu_seqlens is not None:
        return "packed sequences (cu_seqlens)"
    if getattr(config, "multi_latent_attention", False):
        return "multi-latent attention"
    if mla_rotary_interleaved is not False:
        return "MLA-style interleaving (mla_rotary_interleaved)"
    if mscale != 1.0:
        return "mscale != 1"
    if t.dim() != 4:
        return "a tensor not in [s, b, h, d] layout"
    if freqs.dim() != 4 or freqs.shape[1:3] != (1, 1) or freqs.shape[0] not in (1, t.shape[0]):
        return "frequencies per sample (freqs not [s, 1, 1, rot], e.g. mRoPE with batch > 1)"
    return None


def apply_rotary_pos_emb_fused(wrapped, instance, args, kwargs):
    """apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, ...) on the native kernel for the
    [s, b, h, d] layout (rotate-half and interleaved, partial rotary); megatron's code runs otherwise."""
    names = ("t", "freqs", "config", "cu_seqlens", "mscale", "cp_group", "mla_rotary_interleaved")
    bound = bound_arguments(names, args, kwargs, named_only=True)
    config = bound["config"]
    why_not = _rope_needs_megatron(bound["t"], bound["freqs"], config, bound.get("cu_seqlens"),
                                   bound.get("mscale", 1.0), bound.get("mla_rotary_interleaved", False))
    if why_not:
        _warn_fallback("--use-fused-rotary-pos-emb", why_not)
        return wrapped(*args, **kwargs)
    return ops.rotary_pos_emb(bound["t"], bound["freqs"], bool(config.rotary_interleaved))


def _flash_attention_needs_megatron(attn, query, key, attention_mask, attention_bias, packed_seq_params) -> str | None:
    """None when the native path computes what megatron's DotProductAttention computes, else why not."""
    from megatron.core.transformer.enums import AttnMaskType

    if packed_seq_params is not None:
        return "packed sequences (with --packing the varlen attention op serves them; otherwise megatron refuses them)"
    if attention_bias is not None:
        return "attention bias (megatron's DotProductAttention refuses it too)"
    if getattr(attn, "softmax_offset", None) is not None:
        return "softmax offset (--softmax-type off-by-one/learnable)"
    builds_causal_mask = (attention_mask is None and attn.scale_mask_softmax.window_size is None
                          and attn.attn_mask_type == AttnMaskType.causal and query.shape[0] > 1)
    if builds_causal_mask and query.shape[0] != key.shape[0]:
        return "a causal mask with sq != sk (megatron asserts 'causal mask is only for self attention')"
    return None


class CausalMaskRule:
    """Which masks given to a causal-type DotProductAttention are Megatron's default causal mask (True above the
    diagonal), so that the layer runs causal attention without reading the mask (on the NPU: the kernel's causal
    mode with its compressed mask; on CUDA and the CPU: SDPA's is_causal, the same numbers as the mask).

    Known from the configuration, never from the mask's values per layer: Megatron-LM's data loader builds exactly
    that mask unless --reset-attention-mask, so options that carry reset_attention_mask=False (Megatron-LM's
    arguments) say so; options without it (the driver passes no mask) or with it set leave every mask whole. A mask
    must also be boolean [b|1, 1, s, s] with sq == sk. The first such mask is compared with the causal mask once (the
    only host read); if it differs (a script with its own masks), one warning and every mask goes whole from then on.
    """

    def __init__(self, data_masks_are_causal: bool):
        self.trusted = data_masks_are_causal
        self.verified = False

    def is_default_causal(self, mask, sq: int, sk: int) -> bool:
        if not self.trusted or mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
            return False
        if sq != sk or sq < 2 or tuple(mask.shape[-2:]) != (sq, sk):
            return False
        if not self.verified:
            self.verified = True
            future = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu(1)
            if not torch.equal(mask, future.expand_as(mask)):
                self.trusted = False
                warnings.warn("--use-flash-attn: the attention mask of a causal attention layer is not Megatron's "
                              "default causal mask although --reset-attention-mask is off (a data loader of its "
                              "own?); every mask now goes whole to the kernel", RuntimeWarning, stacklevel=3)
                return False
        return True


def dot_product_attention_forward_flash(wrapped, instance, args, kwargs, causal_masks: CausalMaskRule | None = None,
                                        documents=None):
    """DotProductAttention.forward on mm_adaptor.ops.flash_attention (PyTorch's fused kernels: no s x s
    scores kept for backward). Returns [sq, b, hp] like megatron.

    Mirrors megatron's torch softmax path: the sliding-window mask replaces a given mask; without a mask the causal
    mask type builds the causal mask; a mask `causal_masks` knows to be Megatron's default causal one is not read
    (causal attention computes it); a per-document mask (--reset-attention-mask) `documents` (a
    document_masks.DocumentAttention) recognises runs the varlen op on its documents, without dropout only; QK layer
    scaling's coefficient cancels out (fp32 scores here); the dropout
    probability is the module's, in training only, drawn inside the RNG tracker's fork unless sequence parallel."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import get_sliding_window_causal_mask

    if instance is None:
        instance, args = args[0], args[1:]
    names = ("query", "key", "value", "attention_mask", "attn_mask_type", "attention_bias", "packed_seq_params")
    bound = bound_arguments(names, args, kwargs, named_only=True)
    query, key, value = bound["query"], bound["key"], bound["value"]
    mask = bound.get("attention_mask")
    why_not = _flash_attention_needs_megatron(instance, query, key, mask, bound.get("attention_bias"),
                                              bound.get("packed_seq_params"))
    if why_not:
        _warn_fallback("--use-flash-attn", why_not)
        return wrapped(*args, **kwargs)
    softmax = instance.scale_mask_softmax
    causal_type = instance.attn_mask_type == AttnMaskType.causal
    if softmax.window_size is not None:
        mask = get_sliding_window_causal_mask(query.shape[0], key.shape[0], softmax.window_size).to(query.device)
    elif causal_type and causal_masks is not None and causal_masks.is_default_causal(mask, query.shape[0],
                                                                                      key.shape[0]):
        mask = None
    scale = instance.softmax_scale * (softmax.scale or 1.0)
    dropout_p = instance.attention_dropout.p if instance.training else 0.0
    if causal_type and mask is not None and documents is not None and dropout_p == 0:
        segments = documents.segments(mask, query.shape[1], query.shape[0], key.shape[0])
        if segments is not None:
            return documents.attend(query, key, value, segments, scale)
    causal = mask is None and causal_type and query.shape[0] > 1

    def attend():
        return ops.flash_attention(query, key, value, causal=causal, attention_mask=mask, scale=scale,
                                   dropout_p=dropout_p)

    if dropout_p > 0 and not instance.config.sequence_parallel:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            context = attend()
    else:
        context = attend()
    return context.reshape(context.shape[0], context.shape[1], -1)
