"""Packed sequences (megatron's PackedSeqParams, qkv_format "thd") on the local spec's core attention.

Megatron's DotProductAttention asserts `packed_seq_params is None` (only Transformer Engine's attention takes THD).
With packed_seq_params the wrapper here runs mm_adaptor.ops.varlen_attention on query [T, np, hn] and key/value
[T, ng, hn] (Attention.forward squeezes the dummy batch dimension for THD), one causal segment per sample of
cu_seqlens; without, megatron's own forward runs. The trainer and the harness runner apply it for --packing."""

from __future__ import annotations

import torch

from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet, bound_arguments
from mm_adaptor.core.recent import RecentByIdentity

TARGET = "megatron.core.transformer.dot_product_attention.DotProductAttention.forward"
NAME = "packing"


def segment_bounds(packed_seq_params):
    """(cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv) the attention keeps apart: the padded bounds
    where a context-parallel layout gave them, else the samples' own."""
    p = packed_seq_params
    cu_q = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
    cu_kv = p.cu_seqlens_kv_padded if p.cu_seqlens_kv_padded is not None else p.cu_seqlens_kv
    return cu_q, cu_kv, p.max_seqlen_q, p.max_seqlen_kv


class VarlenCalls:
    """How many packed attention calls ran in this process and the segment bounds of the last one (tests read it
    through the driver's memory figures; read on the host only then, not per layer)."""

    def __init__(self):
        self.calls, self._last = 0, None

    @property
    def last_cu_seqlens(self):
        return None if self._last is None else self._last.tolist()


CALLS = VarlenCalls()


class HostBounds:
    """An NPU's TND kernel takes the bounds as host lists: each pack's bounds copied to the host once (its
    PackedSeqParams is shared by every layer of a forward), not read from the device per layer and pass."""

    def __init__(self):
        self._copied = RecentByIdentity()

    def of(self, packed, cu_q, cu_kv):
        def copy(_):
            both = torch.cat([cu_q, cu_kv]).cpu()
            return both[:cu_q.numel()], both[cu_q.numel():]

        return self._copied.get(packed, copy)


HOST_BOUNDS = HostBounds()


def packed_attention_forward(wrapped, instance, args, kwargs):
    """DotProductAttention.forward: THD through varlen_attention, anything else through megatron's."""
    from megatron.core.transformer.enums import AttnMaskType

    from mm_adaptor.ops.varlen_attention import varlen_attention

    if instance is None:
        instance, args = args[0], args[1:]
    names = ("query", "key", "value", "attention_mask", "attn_mask_type", "attention_bias", "packed_seq_params")
    bound = bound_arguments(names, args, kwargs, named_only=True)
    packed = bound.get("packed_seq_params")
    if packed is None or packed.qkv_format != "thd":
        return wrapped(*args, **kwargs)
    if bound.get("attention_bias") is not None:
        raise ValueError("packed sequences with an attention bias: megatron's local attention takes neither")
    query, key, value = bound["query"], bound["key"], bound["value"]
    cu_q, cu_kv, max_q, max_kv = segment_bounds(packed)
    if query.device.type not in ("cpu", "cuda") and cu_q.device.type != "cpu":
        cu_q, cu_kv = HOST_BOUNDS.of(packed, cu_q, cu_kv)
    softmax = instance.scale_mask_softmax
    mask_type = bound.get("attn_mask_type") or instance.attn_mask_type
    window = softmax.window_size
    context = varlen_attention(query, key, value, cu_q, cu_kv, max_q, max_kv,
                               causal=mask_type == AttnMaskType.causal,
                               softmax_scale=instance.softmax_scale * (softmax.scale or 1.0),
                               window=None if window is None else tuple(window))
    CALLS.calls += 1
    CALLS._last = cu_q
    return context.reshape(context.shape[0], -1)  # [t, np * hn]; Attention.forward adds the batch of 1


def patch_set() -> PatchSet:
    ps = PatchSet(NAME)
    ps.wrap(TARGET, packed_attention_forward, contract=Contract(versions=SUPPORTED_MEGATRON_CORE))
    return ps
