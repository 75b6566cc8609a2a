"""varlen_attention: attention over packed variable-length segments (THD layout with cumulative sequence lengths),
causal or not, grouped-query, with an optional sliding window per segment; forward and backward keep no
[S, S] tensor beyond one bounded block of query rows.

Layout: q [Tq, Hq, D], k [Tk, Hk, D], v [Tk, Hk, Dv], Hq a multiple of Hk; cu_seqlens_q/k int32 [B + 1] from 0 to
Tq/Tk. Segment b is rows cu[b]:cu[b + 1]. Causal attention is aligned bottom-right as in flash-attn: query i of a
segment with sq queries and sk keys sees keys j <= i + sk - sq. window=(left, right) keeps keys in
[i + sk - sq - left, i + sk - sq + right] (-1 or None on a side: unlimited). A query that sees no key gets zeros
and log-sum-exp -inf (no contribution when merging blocks, as ring attention does).

The log-sum-exp is [Hq, Tq] in the accumulation dtype (float32; float64 for float64 inputs), differentiable: its
gradient g adds P_ij * g_i to the scores' gradient.

Kernels: the CPU's native kernel (csrc/cpu/varlen_attention.cpp, online softmax); on CUDA torch's flash-attention
varlen kernel (aten._flash_attention_forward with cumulative lengths) for half and bfloat16, the reference
otherwise; on an NPU torch_npu.npu_fusion_attention with input_layout "TND" (npu_varlen_attention). The reference
works one segment and one block of query rows at a time (at most `attention.BLOCK_ELEMENTS` scores), in the
accumulation dtype.
"""

from __future__ import annotations

import warnings

import torch

from mm_adaptor.ops.attention import block_rows
from mm_adaptor.ops.library import OpSpec, accumulation_dtype, ensure, op, register

UNLIMITED = -1
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NPU_MAX_HEAD_DIM, NPU_MAX_HEADS, NPU_MAX_SEGMENTS, NPU_MAX_TOKENS = 768, 256, 1024, 1 << 20
NPU_UNLIMITED = 2147483647  # pre_tockens / next_tockens without a bound
LSE_PAD = 8  # head-dim columns added for a backward with a log-sum-exp gradient (flash wants multiples of 8)
SCHEMA_ARGS = ("Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, bool causal, "
               "float scale, int window_left, int window_right")


def segments(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(q_start, q_end, k_start, k_end) per segment, read on the host."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def visible(rows: torch.Tensor, sq: int, sk: int, causal: bool, left: int, right: int) -> torch.Tensor:
    """Boolean [len(rows), sk]: which keys of a segment each query row (segment-local index) sees."""
    diagonal = rows.view(-1, 1) + (sk - sq)
    keys = torch.arange(sk, device=rows.device).view(1, -1)
    keep = torch.ones(rows.numel(), sk, dtype=torch.bool, device=rows.device)
    if causal:
        right = 0 if right == UNLIMITED else min(right, 0)
    if right != UNLIMITED:
        keep &= keys <= diagonal + right
    if left != UNLIMITED:
        keep &= keys >= diagonal - left
    return keep


def _blocks(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, left, right):
    """Per segment and block of query rows: (query rows slice, [Hq, r, D] q, [Hq, sk, D] k, v, key slice, keep)."""
    acc = accumulation_dtype(q)
    group = q.shape[1] // k.shape[1]
    for q0, q1, k0, k1 in segments(cu_seqlens_q, cu_seqlens_k):
        sq, sk = q1 - q0, k1 - k0
        if sq == 0:
            continue
        kk = k[k0:k1].to(acc).repeat_interleave(group, 1).transpose(0, 1)
        vv = v[k0:k1].to(acc).repeat_interleave(group, 1).transpose(0, 1)
        step = block_rows(1, q.shape[1], max(sk, 1))
        for r0 in range(0, sq, step):
            r1 = min(sq, r0 + step)
            keep = visible(torch.arange(r0, r1, device=q.device), sq, sk, causal, left, right)
            yield slice(q0 + r0, q0 + r1), q[q0 + r0:q0 + r1].to(acc).transpose(0, 1), kk, vv, slice(k0, k1), keep


def reference_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left,
                  window_right):
    acc = accumulation_dtype(q)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)
    for rows, qq, kk, vv, _, keep in _blocks(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window_left, window_right):
        scores = (qq @ kk.transpose(1, 2) * scale).masked_fill(~keep, float("-inf"))  # [Hq, r, sk]
        row_max = scores.amax(-1, keepdim=True).nan_to_num(neginf=0.0) if scores.shape[-1] else \
            scores.new_zeros(*scores.shape[:-1], 1)
        probs = torch.exp(scores - row_max)
        total = probs.sum(-1, keepdim=True)
        out[rows] = ((probs @ vv) / total.clamp_min(torch.finfo(acc).tiny)).transpose(0, 1)
        lse[:, rows] = (row_max + total.log()).squeeze(-1)
    return out.to(q.dtype), lse


def reference_bwd(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                  scale, window_left, window_right):
    acc = accumulation_dtype(q)
    hq, hk = q.shape[1], k.shape[1]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape[0], hq, k.shape[2], dtype=acc, device=q.device)
    dv = torch.zeros(v.shape[0], hq, v.shape[2], dtype=acc, device=q.device)
    # the softmax's gradient per row: rowsum(dout * out), less the log-sum-exp's gradient
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(0, 1)  # [Hq, Tq]
    if dlse is not None:
        delta = delta - dlse.to(acc)
    for rows, qq, kk, vv, keys, keep in _blocks(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window_left,
                                                 window_right):
        row_lse = lse[:, rows].to(acc).unsqueeze(-1)
        probs = torch.exp(qq @ kk.transpose(1, 2) * scale - row_lse.nan_to_num(neginf=float("inf")))
        probs = probs.masked_fill(~keep, 0.0)
        g = dout[rows].to(acc).transpose(0, 1)  # [Hq, r, Dv]
        dv[keys] += (probs.transpose(1, 2) @ g).transpose(0, 1)
        dscores = probs * (g @ vv.transpose(1, 2) - delta[:, rows].unsqueeze(-1)) * scale
        dq[rows] = (dscores @ kk).transpose(0, 1)
        dk[keys] += (dscores.transpose(1, 2) @ qq).transpose(0, 1)
    group = hq // hk
    dk = dk.view(k.shape[0], hk, group, k.shape[2]).sum(2)
    dv = dv.view(v.shape[0], hk, group, v.shape[2]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def fake_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left,
             window_right):
    return (q.new_empty(q.shape[0], q.shape[1], v.shape[-1]),
            q.new_empty(q.shape[1], q.shape[0], dtype=accumulation_dtype(q)))


def fake_bwd(dout, dlse, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def with_lse_gradient(dout, dlse, q, k, v, out, pad: int = LSE_PAD):
    """Inputs for a flash-attention backward without a log-sum-exp gradient that yield the gradients with one: the
    head dim grows by `pad` zeros, v gains a column of ones and dout the column dlse, so dP_ij grows by dlse_i while
    rowsum(dout * out), taken from the unchanged out, does not; the first D (Dv) columns of dq, dk (dv) are the
    answer."""
    def padded(t, column=None):
        extra = t.new_zeros(*t.shape[:-1], pad)
        if column is not None:
            extra[..., 0] = column
        return torch.cat([t, extra], -1)

    return (padded(dout, dlse.transpose(0, 1)), padded(q), padded(k), padded(v, 1.0), padded(out))


def cuda_serves(q, v) -> bool:
    """torch's flash-attention varlen kernel: half or bfloat16, equal head dims, a multiple of 8 up to 256, sm80+."""
    d = q.shape[-1]
    return (q.dtype in FLASH_DTYPES and v.shape[-1] == d and d % 8 == 0 and d <= FLASH_MAX_HEAD_DIM
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


def cuda_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left,
             window_right):
    if not cuda_serves(q, v):
        return reference_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                             window_left, window_right)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q.to(q.device), cu_seqlens_k.to(q.device), max_seqlen_q, max_seqlen_k, 0.0, causal,
        False, scale=scale, window_size_left=window_left, window_size_right=window_right)
    return out, lse.masked_fill(lse == float("inf"), float("-inf"))  # flash marks rows without keys with +inf


def cuda_bwd(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
             window_left, window_right):
    if not cuda_serves(q, v) or (dlse is not None and q.shape[-1] + LSE_PAD > FLASH_MAX_HEAD_DIM):
        return reference_bwd(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             causal, scale, window_left, window_right)
    d = q.shape[-1]
    flash_lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    if dlse is not None:
        dout, q, k, v, out = with_lse_gradient(dout, dlse, q, k, v, out)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, flash_lse, cu_seqlens_q.to(q.device), cu_seqlens_k.to(q.device), max_seqlen_q,
        max_seqlen_k, 0.0, causal, torch.zeros(2, dtype=torch.uint64, device=q.device),
        torch.empty(0, device=q.device), scale=scale, window_size_left=window_left, window_size_right=window_right)
    return dq[..., :d], dk[..., :d], dv[..., :d]


def rows_without_keys(cu_seqlens_q, cu_seqlens_k, causal, right) -> bool:
    """Whether some query row sees no key (read on the host): a segment without keys, or a first row whose right
    bound falls before the first key (a left bound never empties a row: the last key is always within it)."""
    right = 0 if causal else right
    for q0, q1, k0, k1 in segments(cu_seqlens_q, cu_seqlens_k):
        sq, sk = q1 - q0, k1 - k0
        if sq and (sk == 0 or (right != UNLIMITED and sk - sq + right < 0)):
            return True
    return False


def npu_why_not(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, left, right, lse_gradient=False) -> str | None:
    """Why npu_fusion_attention's TND (varlen) form cannot take these arguments (its documented limits), or None."""
    d = q.shape[-1] + (LSE_PAD if lse_gradient else 0)
    if q.dtype not in NPU_DTYPES:
        return f"dtype {q.dtype} (it takes float16, bfloat16, float32)"
    if not 1 <= d <= NPU_MAX_HEAD_DIM or v.shape[-1] > q.shape[-1]:
        return f"head dims q/k {d}, v {v.shape[-1]} (1 to {NPU_MAX_HEAD_DIM}, Dv <= Dk)"
    if q.shape[1] > NPU_MAX_HEADS:
        return f"{q.shape[1]} query heads (at most {NPU_MAX_HEADS})"
    if not 1 <= cu_seqlens_q.numel() - 1 <= NPU_MAX_SEGMENTS:
        return f"{cu_seqlens_q.numel() - 1} segments (1 to {NPU_MAX_SEGMENTS} in the TND layout)"
    if not (1 <= q.shape[0] <= NPU_MAX_TOKENS and 1 <= k.shape[0] <= NPU_MAX_TOKENS):
        return f"{q.shape[0]} query and {k.shape[0]} key tokens (1 to {NPU_MAX_TOKENS})"
    if rows_without_keys(cu_seqlens_q, cu_seqlens_k, causal, right):
        return "a query row without keys (no fully masked row in the TND layout)"
    return None


def npu_sparse_arguments(causal, left, right, device) -> dict:
    """No mask for full attention; sparse_mode 3 (rightDownCausal, the compressed 2048 x 2048 mask) for causal;
    sparse_mode 4 (band from the bottom-right corner, the same compressed mask) for a window."""
    from mm_adaptor.ops.npu_attention import _causal_mask

    if left == UNLIMITED and right == UNLIMITED and not causal:
        return {}
    if left == UNLIMITED and causal:
        return {"atten_mask": _causal_mask(device), "sparse_mode": 3}
    pre = NPU_UNLIMITED if left == UNLIMITED else left
    nxt = 0 if causal else NPU_UNLIMITED if right == UNLIMITED else right
    return {"atten_mask": _causal_mask(device), "sparse_mode": 4, "pre_tockens": pre, "next_tockens": nxt}


def _npu_fallback(why: str) -> None:
    if why not in _NPU_WARNED:
        _NPU_WARNED.add(why)
        warnings.warn(f"varlen_attention on NPU: npu_fusion_attention does not take {why}; the plain-PyTorch "
                      "reference runs instead (correct, slower)", RuntimeWarning, stacklevel=4)


_NPU_WARNED: set = set()


def npu_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left,
            window_right):
    args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left, window_right)
    why = npu_why_not(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window_left, window_right)
    if why is not None:
        _npu_fallback(why)
        return reference_fwd(q, k, v, *args)
    import torch_npu

    out, softmax_max, softmax_sum, *_ = torch_npu.npu_fusion_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), q.shape[1], "TND", scale=scale,
        actual_seq_qlen=cu_seqlens_q[1:].tolist(), actual_seq_kvlen=cu_seqlens_k[1:].tolist(),
        **npu_sparse_arguments(causal, window_left, window_right, q.device))
    lse = softmax_max[..., 0] + softmax_sum[..., 0].log()  # [T, N, 8] each
    return out, lse.transpose(0, 1).contiguous()


def npu_bwd(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
            window_left, window_right):
    args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left, window_right)
    why = npu_why_not(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window_left, window_right, dlse is not None)
    if why is not None:
        _npu_fallback(why)
        return reference_bwd(dout, dlse, q, k, v, out, lse, *args)
    d, dv_dim = q.shape[-1], v.shape[-1]
    if dlse is not None:
        dout, q, k, v, out = with_lse_gradient(dout, dlse, q, k, v, out)
    # the kernel's probabilities exp(s - max) / sum, from the log-sum-exp alone: max = lse, sum = 1
    softmax_max = lse.float().transpose(0, 1).unsqueeze(-1).expand(-1, -1, 8).contiguous()
    dq, dk, dv, *_ = torch.ops.npu.npu_fusion_attention_grad(
        q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous(), q.shape[1], "TND",
        softmax_max=softmax_max, softmax_sum=torch.ones_like(softmax_max), attention_in=out.contiguous(),
        scale_value=scale, actual_seq_qlen=cu_seqlens_q[1:].tolist(), actual_seq_kvlen=cu_seqlens_k[1:].tolist(),
        **npu_sparse_arguments(causal, window_left, window_right, q.device))
    return dq[..., :d], dk[..., :d], dv[..., :dv_dim]


def setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)
    ctx.arguments = (max_q, max_k, causal, scale, left, right)
    ctx.set_materialize_grads(False)


def backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = op("varlen_attention_bwd")(dout.contiguous(), dlse, q, k, v, out, lse, cu_q, cu_k, *ctx.arguments)
    return dq, dk, dv, None, None, None, None, None, None, None, None


SPECS = register(
    OpSpec("varlen_attention_fwd", f"(Tensor q, Tensor k, Tensor v, {SCHEMA_ARGS}) -> (Tensor, Tensor)",
           reference_fwd, fake_fwd, native=("cpu",), backward=backward, setup_context=setup_context, cuda=cuda_fwd,
           npu=npu_fwd),
    OpSpec("varlen_attention_bwd", f"(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, "
           f"Tensor lse, {SCHEMA_ARGS}) -> (Tensor, Tensor, Tensor)", reference_bwd, fake_bwd, native=("cpu",),
           cuda=cuda_bwd, npu=npu_bwd),
)


def _window(window) -> tuple[int, int]:
    if window is None:
        return UNLIMITED, UNLIMITED
    if len(window) != 2:
        raise ValueError(f"varlen_attention: window must be (left, right), got {window!r}")
    sides = tuple(UNLIMITED if side is None else int(side) for side in window)
    if any(side < UNLIMITED for side in sides):
        raise ValueError(f"varlen_attention: window sides must be >= 0 (or -1/None for unlimited), got {window!r}")
    return sides


def check_arguments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """Shapes and dtypes always; the lengths' values only where they already live on the host (the CPU)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"varlen_attention: expected [T, H, D] tensors, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise ValueError(f"varlen_attention: k {tuple(k.shape)} and v {tuple(v.shape)} do not match q "
                         f"{tuple(q.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"varlen_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value "
                         "heads")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"varlen_attention: {name} must be a 1-D int32 tensor, got {cu.dtype} "
                             f"{tuple(cu.shape)}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"varlen_attention: cu_seqlens_q has {cu_seqlens_q.numel()} entries, cu_seqlens_k "
                         f"{cu_seqlens_k.numel()}")
    if cu_seqlens_q.device.type != "cpu" or cu_seqlens_k.device.type != "cpu":
        return
    for name, cu, total, longest in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                     ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
        lengths = cu.diff()
        if cu[0] != 0 or cu[-1] != total or bool((lengths < 0).any()):
            raise ValueError(f"varlen_attention: {name} must rise from 0 to {total}, got {cu.tolist()}")
        if lengths.numel() and int(lengths.max()) > longest:
            raise ValueError(f"varlen_attention: a segment of {int(lengths.max())} exceeds max_seqlen {longest} "
                             f"({name})")


def varlen_attention_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal: bool,
                              softmax_scale: float | None = None,
                              window: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention within each segment of packed q [Tq, Hq, D], k [Tk, Hk, D], v [Tk, Hk, Dv] (see the module's
    docstring). Returns out [Tq, Hq, Dv] and the log-sum-exp [Hq, Tq] (float32; float64 for float64 inputs)."""
    check_arguments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    left, right = _window(window)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    ensure(q.device.type)
    return op("varlen_attention_fwd")(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                      bool(causal), scale, left, right)


def bounds_for_kernel(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-side bounds where the kernel on `device` reads them: CUDA's varlen flash kernel on the device; the CPU
    kernel, the reference and an NPU's TND kernel (which takes host lists) on the host, where they stay (bounds on
    an NPU would be read back to the host in every call)."""
    return cu_seqlens.to(device, non_blocking=True) if device.type == "cuda" else cu_seqlens


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal: bool,
                     softmax_scale: float | None = None, window: tuple[int, int] | None = None) -> torch.Tensor:
    """Attention within each segment of packed THD tensors; see `varlen_attention_with_lse`. Returns [Tq, Hq, Dv]."""
    return varlen_attention_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                     softmax_scale=softmax_scale, window=window)[0]
