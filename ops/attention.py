"""flash_attention for Megatron's [s, b, h, d] layout through PyTorch's fused scaled-dot-product kernels.

PyTorch's fused SDPA kernels are already operators with their own autograd that keep only the log-sum-exp
for backward (no s x s matrix); this function restricts SDPA to those kernels (an error instead of a silent
fall-back to the s x s math path), handles grouped-query attention and Megatron's masks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FUSED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    attention_mask: torch.Tensor | None = None, scale: float | None = None,
                    dropout_p: float = 0.0) -> torch.Tensor:
    """q: [sq, b, hq, d]; k, v: [sk, b, hkv, d] with hq a multiple of hkv. attention_mask: boolean, True = masked
    out (Megatron's convention), broadcastable to [b, hq, sq, sk]. Returns [sq, b, hq, d]."""
    if dropout_p:
        raise ValueError("flash_attention: attention dropout is not supported (its mask could not be reproduced "
                         "under Megatron's RNG tracker); use --attention-dropout 0")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash_attention: expected [s, b, h, d] tensors, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    hq, hkv = q.shape[2], k.shape[2]
    if hq % hkv:
        raise ValueError(f"flash_attention: {hq} query heads are not a multiple of {hkv} key/value heads")
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    if hkv != hq:
        kb = kb.repeat_interleave(hq // hkv, dim=1)
        vb = vb.repeat_interleave(hq // hkv, dim=1)
    mask = None
    if attention_mask is not None:
        mask = ~attention_mask.to(torch.bool)  # SDPA: True = attend
        if causal:
            sq, sk = q.shape[0], k.shape[0]
            keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            mask = mask & keep
            causal = False
    with sdpa_kernel(FUSED_BACKENDS):
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=causal, scale=scale)
    return out.permute(2, 0, 1, 3)
