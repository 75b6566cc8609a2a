"""flash_attention for Megatron's [s, b, h, d] layout: PyTorch's fused scaled-dot-product kernels, and a blockwise
fp32 path where they cannot serve (attention dropout on the CPU, value head dim != query head dim).

PyTorch's fused SDPA kernels are already operators with their own autograd that keep only the log-sum-exp
for backward (no s x s matrix); this function restricts SDPA to those kernels (an error instead of a silent
fall-back to the s x s math path), handles grouped-query attention and Megatron's masks.

On an Ascend NPU it runs torch_npu.npu_fusion_attention (npu_attention.py), never torch_npu's SDPA (which may fall
back to the s x s math path silently); where that kernel cannot serve, the blockwise fp32 path, with one warning.

Masking follows Megatron's DotProductAttention (scores of masked positions become -10000 before the softmax):
a row whose keys are all masked attends uniformly to every key (on the fused kernels with dropout, without
dropout on that row: the kernels' mask is not ours to apply).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FUSED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
# Devices whose fused SDPA kernels take a dropout probability (drawn from the device generator, seed kept for
# backward); on the CPU the fused kernels refuse dropout (the NPU runs npu_fusion_attention, not SDPA).
FUSED_DROPOUT_DEVICES = ("cuda",)
MASKED_SCORE = -10000.0  # megatron's attention_mask_func
# Score elements per block of query rows in the blockwise path (b * h * rows * sk).
BLOCK_ELEMENTS = 1 << 22


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    attention_mask: torch.Tensor | None = None, scale: float | None = None,
                    dropout_p: float = 0.0) -> torch.Tensor:
    """q: [sq, b, hq, d]; k: [sk, b, hkv, d]; v: [sk, b, hkv, dv] with hq a multiple of hkv. attention_mask: boolean,
    True = masked out (Megatron's convention), broadcastable to [b, hq, sq, sk]. causal: query i sees keys
    j <= i + sk - sq. dropout_p: dropout on the attention probabilities, drawn from the current default generator
    of the tensors' device (run it inside megatron's RNG tracker fork to reproduce it under recompute).
    Returns [sq, b, hq, dv]."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash_attention: expected [s, b, h, d] tensors, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    hq, hkv = q.shape[2], k.shape[2]
    if hq % hkv:
        raise ValueError(f"flash_attention: {hq} query heads are not a multiple of {hkv} key/value heads")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"flash_attention: dropout_p must be in [0, 1], got {dropout_p}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.device.type == "npu":
        return _npu_attention(q, k, v, causal, attention_mask, scale, float(dropout_p))
    fused_serves = v.shape[-1] == q.shape[-1] and (dropout_p == 0 or q.device.type in FUSED_DROPOUT_DEVICES)
    if not fused_serves:
        return BlockwiseAttention.apply(q, k, v, attention_mask, causal, scale, float(dropout_p))
    return _fused_attention(q, k, v, causal, attention_mask, scale, dropout_p)


def _npu_attention(q, k, v, causal, attention_mask, scale, dropout_p):
    from mm_adaptor.ops import npu_attention

    why = npu_attention.why_not(q, k, v) or ("dropout_p 1 (its keep_prob must be above 0)" if dropout_p >= 1 else None)
    if why is None:
        return npu_attention.fusion_attention(q, k, v, causal, attention_mask, scale, dropout_p)
    if why not in _NPU_WARNED:
        _NPU_WARNED.add(why)
        warnings.warn(f"flash_attention on NPU: npu_fusion_attention does not take {why}; the blockwise fp32 kernel "
                      "runs instead (no s x s matrix kept, slower)", RuntimeWarning, stacklevel=3)
    return BlockwiseAttention.apply(q, k, v, attention_mask, causal, scale, dropout_p)


_NPU_WARNED: set = set()


def _fused_attention(q, k, v, causal, attention_mask, scale, dropout_p):
    hq, hkv = q.shape[2], k.shape[2]
    sq, sk = q.shape[0], k.shape[0]
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    if hkv != hq:
        kb = kb.repeat_interleave(hq // hkv, dim=1)
        vb = vb.repeat_interleave(hq // hkv, dim=1)
    attend = None if attention_mask is None else ~attention_mask.to(torch.bool)  # SDPA: True = attend
    if causal and (attend is not None or sq != sk):
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        attend = keep if attend is None else attend & keep
        causal = False
    fully_masked = None
    if attend is not None:
        # SDPA gives such rows zeros; megatron's -10000 fill gives the uniform average of the values
        fully_masked = ~attend.any(-1, keepdim=True)
        attend = attend | fully_masked
    with sdpa_kernel(FUSED_BACKENDS):
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=attend, dropout_p=dropout_p, is_causal=causal,
                                             scale=scale)
    if fully_masked is not None:
        uniform = vb.mean(-2, keepdim=True, dtype=_acc(q)).to(out.dtype)
        out = torch.where(fully_masked, uniform, out)
    return out.permute(2, 0, 1, 3)


def _acc(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def draw_seed(device: torch.device) -> int:
    """One dropout seed from the current default generator of `device` (what megatron's RNG tracker controls)."""
    return int(torch.randint(1 << 62, (1,), device=device).item())


def block_rows(b: int, h: int, sk: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(1, b * h * sk))


def dropout_keep_blocks(seed: int, shape: tuple[int, int, int, int], dropout_p: float, rows: int,
                        device: torch.device):
    """The dropout keep mask, scaled by 1 / (1 - p), of each block of `rows` query rows ([b, h, rows, sk], the last
    block shorter), from one generator seeded with `seed`, drawn block after block: forward and backward regenerate
    the same masks."""
    b, h, sq, sk = shape
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    keep_scale = 0.0 if dropout_p >= 1 else 1.0 / (1.0 - dropout_p)
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        draw = torch.rand((b, h, r1 - r0, sk), generator=generator, device=device)
        yield (draw >= dropout_p) * keep_scale


def _masked_block(attention_mask, causal, r0, r1, sq, sk, device):
    """Boolean [.., r1 - r0, sk] (True = masked out) for query rows r0..r1, or None."""
    masked = None
    if attention_mask is not None:
        mask = attention_mask.to(torch.bool)
        masked = mask[..., r0:r1, :] if mask.dim() > 1 and mask.shape[-2] > 1 else mask
    if causal:
        rows = torch.arange(r0, r1, device=device).unsqueeze(-1) + (sk - sq)
        future = torch.arange(sk, device=device) > rows
        masked = future if masked is None else masked | future
    return masked


class BlockwiseAttention(torch.autograd.Function):
    """Attention in fp32 (fp64 for fp64) over blocks of query rows, with dropout masks regenerated from one seed.
    Saves q, k, v, the output, the row log-sum-exp (as row max and row sum of exponentials, so that backward
    recomputes forward's probabilities bit for bit, also for fully masked rows) and the seed: no s x s tensor is kept
    for backward."""

    @staticmethod
    def forward(ctx, q, k, v, attention_mask, causal, scale, dropout_p):
        (sq, b, hq, _), sk = q.shape, k.shape[0]
        seed = draw_seed(q.device) if dropout_p > 0 else 0
        rows = block_rows(b, hq, sk)
        qf, kf, vf = _blocked_inputs(q, k, v)
        out = qf.new_empty((b, hq, sq, v.shape[-1]))
        row_max, row_sum = qf.new_empty((b, hq, sq, 1)), qf.new_empty((b, hq, sq, 1))
        keeps = dropout_keep_blocks(seed, (b, hq, sq, sk), dropout_p, rows, q.device) if dropout_p > 0 else None
        for r0 in range(0, sq, rows):
            r1 = min(sq, r0 + rows)
            scores, _ = _block_scores(qf, kf, attention_mask, causal, scale, r0, r1)
            row_max[:, :, r0:r1] = scores.amax(-1, keepdim=True)
            exp_scores = torch.exp(scores - row_max[:, :, r0:r1])
            row_sum[:, :, r0:r1] = exp_scores.sum(-1, keepdim=True)
            probs = exp_scores / row_sum[:, :, r0:r1]
            if keeps is not None:
                probs = probs * next(keeps)
            out[:, :, r0:r1] = probs @ vf
        out = out.to(q.dtype).permute(2, 0, 1, 3)
        ctx.save_for_backward(q, k, v, out, row_max, row_sum, attention_mask)
        ctx.causal, ctx.scale, ctx.dropout_p, ctx.seed, ctx.rows = causal, scale, dropout_p, seed, rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, row_max, row_sum, attention_mask = ctx.saved_tensors
        (sq, b, hq, _), (sk, _, hkv, _) = q.shape, k.shape
        qf, kf, vf = _blocked_inputs(q, k, v)
        acc = qf.dtype
        dout = grad_out.permute(1, 2, 0, 3).to(acc)
        delta = (dout * out.permute(1, 2, 0, 3).to(acc)).sum(-1)  # rowsum(dO * O): [b, hq, sq]
        dq, dk, dv = torch.empty_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        keeps = (dropout_keep_blocks(ctx.seed, (b, hq, sq, sk), ctx.dropout_p, ctx.rows, q.device)
                 if ctx.dropout_p > 0 else None)
        for r0 in range(0, sq, ctx.rows):
            r1 = min(sq, r0 + ctx.rows)
            scores, masked = _block_scores(qf, kf, attention_mask, ctx.causal, ctx.scale, r0, r1)
            probs = torch.exp(scores - row_max[:, :, r0:r1]) / row_sum[:, :, r0:r1]  # forward's, bit for bit
            d_kept = dout[:, :, r0:r1] @ vf.transpose(-1, -2)  # d(dropped probs)
            kept = probs
            if keeps is not None:
                keep = next(keeps)
                kept, d_kept = probs * keep, d_kept * keep
            dv += kept.transpose(-1, -2) @ dout[:, :, r0:r1]
            d_scores = probs * (d_kept - delta[:, :, r0:r1].unsqueeze(-1))
            if masked is not None:  # masked scores are constants
                d_scores = d_scores.masked_fill(masked, 0.0)
            dq[:, :, r0:r1] = (d_scores @ kf) * ctx.scale
            dk += (d_scores.transpose(-1, -2) @ qf[:, :, r0:r1]) * ctx.scale
        if hkv != hq:
            dk = dk.view(b, hkv, hq // hkv, sk, -1).sum(2)
            dv = dv.view(b, hkv, hq // hkv, sk, -1).sum(2)
        dq, dk, dv = (g.permute(2, 0, 1, 3).to(t.dtype) for g, t in ((dq, q), (dk, k), (dv, v)))
        return dq, dk, dv, None, None, None, None


def _blocked_inputs(q, k, v):
    """q, k, v as [b, hq, s, d] in the accumulation dtype, keys and values repeated for grouped-query attention."""
    acc, group = _acc(q), q.shape[2] // k.shape[2]
    qf, kf, vf = (t.permute(1, 2, 0, 3).to(acc) for t in (q, k, v))
    if group > 1:
        kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    return qf, kf, vf


def _block_scores(qf, kf, attention_mask, causal, scale, r0, r1):
    """Scaled, masked scores of query rows r0..r1 [b, hq, r1 - r0, sk], and the mask (True = masked out) or None."""
    scores = (qf[:, :, r0:r1] @ kf.transpose(-1, -2)) * scale
    masked = _masked_block(attention_mask, causal, r0, r1, qf.shape[2], kf.shape[2], qf.device)
    if masked is not None:
        scores = scores.masked_fill(masked, MASKED_SCORE)
    return scores, masked
