"""flash_attention on Ascend NPUs: torch_npu.npu_fusion_attention (FlashAttentionScore), whose autograd torch_npu
registers (npu_fusion_attention_grad), in place of torch_npu's SDPA, which may fall back to the s x s math path
without saying so.

Megatron's [s, b, h, d] tensors go in as layout "SBH" (heads folded into H; grouped-query attention as fewer key/value
heads, which the kernel takes when Nq is a multiple of Nkv). Masks follow Megatron's convention (True = masked out),
as the kernel's atten_mask does.

Causal attention without a mask runs sparse_mode 3 (rightDownCausal: query i sees keys j <= i + sk - sq) with the
compressed 2048 x 2048 mask torch_npu documents for it, so the kernel skips the masked blocks. Megatron's default
causal mask arrives here that way: the --use-flash-attn patch recognises it from the configuration, never from its
values (patches/transformer/fused_ops.py, CausalMaskRule). Any other mask goes in whole (sparse_mode 0); rows whose
keys are all masked get megatron's uniform average of the values, as on the other devices, selected on the device
(no host read per layer). Attention dropout: keep_prob = 1 - p, the kernel's mask seeded from the NPU generator,
which megatron's RNG tracker controls.

Where torch_npu documents no kernel (see `why_not`), the caller runs the blockwise fp32 kernel instead.
"""

from __future__ import annotations

import torch

NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
COMPRESSED_CAUSAL = 2048
_CAUSAL_MASKS: dict = {}


def why_not(q, k, v) -> str | None:
    """Why npu_fusion_attention cannot take these [s, b, h, d] tensors (its documented limits), or None."""
    if q.dtype not in NPU_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (npu_fusion_attention takes float16, bfloat16, float32)"
    if not 1 <= q.shape[-1] <= 768 or v.shape[-1] > k.shape[-1]:
        return f"head dims q/k {q.shape[-1]}, v {v.shape[-1]} (1 to 768, Dv <= Dk)"
    if v.shape[-1] != q.shape[-1]:
        return "a value head dim other than the query's (layout SBH folds one head dim into H)"
    if q.shape[2] > 256:
        return f"{q.shape[2]} query heads (at most 256)"
    return None


def _causal_mask(device) -> torch.Tensor:
    mask = _CAUSAL_MASKS.get(device)
    if mask is None:
        ones = torch.ones(COMPRESSED_CAUSAL, COMPRESSED_CAUSAL, dtype=torch.bool, device=device)
        mask = _CAUSAL_MASKS[device] = ones.triu(1)
    return mask


def _full_mask(attention_mask, causal, sq, sk, device):
    """Boolean [b|1, hq|1, sq, sk] (the kernel's BNSS, B1SS or 11SS), True = masked out, or None."""
    masked = None
    if attention_mask is not None:
        masked = attention_mask.to(torch.bool)
        while masked.dim() < 4:
            masked = masked.unsqueeze(0)
        masked = masked.expand(masked.shape[0], masked.shape[1], sq, sk)
    if causal:
        future = torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1).view(1, 1, sq, sk)
        masked = future if masked is None else masked | future
    return masked


def fusion_attention(q, k, v, causal, attention_mask, scale, dropout_p) -> torch.Tensor:
    """q: [sq, b, hq, d]; k, v: [sk, b, hkv, d]; attention_mask: True = masked out. Returns [sq, b, hq, d].

    causal with no attention_mask and sq <= sk: sparse_mode 3 with the compressed 2048 x 2048 mask. Otherwise the
    mask (with the causal part folded in) goes whole as sparse_mode 0. No host synchronisation on either path."""
    import torch_npu

    (sq, b, hq, d), sk = q.shape, k.shape[0]
    kwargs, fully_masked = {}, None
    if causal and attention_mask is None and sq <= sk:  # no row without keys: the kernel's own causal mode
        kwargs = {"atten_mask": _causal_mask(q.device), "sparse_mode": 3}
    else:
        masked = _full_mask(attention_mask, causal, sq, sk, q.device)
        if masked is not None:
            fully_masked = masked.all(-1, keepdim=True)
            kwargs = {"atten_mask": (masked & ~fully_masked).contiguous(), "sparse_mode": 0}
    out = torch_npu.npu_fusion_attention(
        q.reshape(sq, b, hq * d), k.reshape(sk, b, -1), v.reshape(sk, b, -1), hq, "SBH", scale=scale,
        keep_prob=1.0 - dropout_p, **kwargs)[0].view(sq, b, hq, d)
    if fully_masked is not None:  # unconditionally: asking whether any row is fully masked would read the device
        group = hq // k.shape[2]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        uniform = v.mean(0, keepdim=True, dtype=acc).repeat_interleave(group, 2).to(out.dtype)  # [1, b, hq, d]
        rows = fully_masked.expand(-1, hq, -1, -1).permute(2, 0, 1, 3)  # [sq, b|1, hq, 1]
        out = torch.where(rows, uniform, out)
    return out
