"""rotary_pos_emb: Megatron's apply_rotary_pos_emb for [s, b, h, d], rotate-half or interleaved, partial rotary.
Native kernels: csrc/cpu/rotary_pos_emb.cpp, csrc/cuda/; NPU: torch_npu.npu_rotary_mul and npu_rotary_mul_backward,
rotary_mode 'half' or 'interleave', or the three-argument rotate-half of torch_npu without rotary_mode (the reference
where torch_npu documents no kernel: see npu_serves)."""

from __future__ import annotations

import torch

from mm_adaptor.ops.library import OpSpec, accumulation_dtype, ensure, npu_op_arguments, op, register


def _pairs(t, rot, interleaved):
    if interleaved:
        return t[..., 0:rot:2], t[..., 1:rot:2]
    return t[..., : rot // 2], t[..., rot // 2: rot]


def _rope(t, freqs, interleaved, backward):
    rot = freqs.shape[-1]
    tf = t.to(accumulation_dtype(t))
    f = freqs.to(tf.dtype)
    cos, sin = torch.cos(f), torch.sin(f)
    x0, x1 = _pairs(tf, rot, interleaved)
    c0, c1 = _pairs(cos, rot, interleaved)
    s0, s1 = _pairs(sin, rot, interleaved)
    if backward:
        y0, y1 = x0 * c0 + x1 * s1, x1 * c1 - x0 * s0
    else:
        y0, y1 = x0 * c0 - x1 * s0, x1 * c1 + x0 * s1
    out = tf.clone()
    if interleaved:
        out[..., 0:rot:2], out[..., 1:rot:2] = y0, y1
    else:
        out[..., : rot // 2], out[..., rot // 2: rot] = y0, y1
    return out.to(t.dtype)


def reference_fwd(t, freqs, interleaved):
    return _rope(t, freqs, interleaved, backward=False)


def reference_bwd(dy, freqs, interleaved):
    return _rope(dy, freqs, interleaved, backward=True)


def fake_fwd(t, freqs, interleaved):
    return torch.empty_like(t)


def fake_bwd(dy, freqs, interleaved):
    return torch.empty_like(dy)


NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def takes_rotary_mode() -> bool:
    """Whether torch_npu's npu_rotary_mul has the rotary_mode argument (op-plugin 7.0.0 on; 6.0.0, torch_npu for
    torch 2.4 included, has npu_rotary_mul(self, r1, r2), rotate-half only)."""
    return "rotary_mode" in npu_op_arguments("npu_rotary_mul")


def npu_serves(t, freqs, interleaved, backward=False) -> bool:
    """torch_npu's documented limits (op-plugin docs, jit_compile=False on Atlas A2/A3) for megatron's layout: t as
    SBND [s, b, h, d] (or TND [t, h, d], B = 1) with cos/sin [s, 1, 1, d] (or [t, 1, d]), float16/bfloat16/float32,
    D even and below 896; rotate-half B < 1000 and N < 1000, interleave B*N < 1000. The backward kernel computes the
    cos/sin gradients as well (op-plugin before 7.1.0 and the aclop path always do), which needs B*N <= 1024.
    Without rotary_mode (op-plugin 6.0.0): rotate-half, 4-D, D = 128, B and N <= 1000, B*N <= 1024 (its broadcast
    limit), and s > 1 (one position also reads as BNSD, where 6.0.0 refuses B*N > 8*S)."""
    rot = freqs.shape[-1]
    if t.dtype not in NPU_DTYPES or t.dim() not in (3, 4) or freqs.dim() != t.dim() or rot % 2 or not 0 < rot < 896:
        return False
    if tuple(freqs.shape[:-1]) != (t.shape[0], *[1] * (t.dim() - 2)):
        return False
    b, n = (t.shape[1], t.shape[2]) if t.dim() == 4 else (1, t.shape[1])
    if not takes_rotary_mode():
        return (not interleaved and t.dim() == 4 and rot == 128 and t.shape[0] > 1 and b <= 1000 and n <= 1000
                and b * n <= 1024)
    if interleaved:
        return b * n < 1000
    return b < 1000 and n < 1000 and (not backward or b * n <= 1024)


def _npu_rotary(t, freqs, interleaved, backward):
    import torch_npu

    rot = freqs.shape[-1]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    mode = ("interleave" if interleaved else "half",) if takes_rotary_mode() else ()
    head = t[..., :rot]
    if backward:  # `self` is x, read only for the cos/sin gradients, which are discarded: dy stands in for it
        rotated = torch_npu.npu_rotary_mul_backward(head, head, cos, sin, *mode)[0]
    else:
        rotated = torch_npu.npu_rotary_mul(head, cos, sin, *mode)
    return rotated if rot == t.shape[-1] else torch.cat([rotated, t[..., rot:]], dim=-1)


def npu_fwd(t, freqs, interleaved):
    if not npu_serves(t, freqs, interleaved):
        return reference_fwd(t, freqs, interleaved)
    return _npu_rotary(t, freqs, interleaved, backward=False)


def npu_bwd(dy, freqs, interleaved):
    if not npu_serves(dy, freqs, interleaved, backward=True):
        return reference_bwd(dy, freqs, interleaved)
    return _npu_rotary(dy, freqs, interleaved, backward=True)


def setup_context(ctx, inputs, output):
    _t, freqs, interleaved = inputs
    ctx.save_for_backward(freqs)
    ctx.interleaved = interleaved


def backward(ctx, dy):
    (freqs,) = ctx.saved_tensors
    return op("rotary_pos_emb_bwd")(dy.contiguous(), freqs, ctx.interleaved), None, None


SPECS = register(
    OpSpec("rotary_pos_emb_fwd", "(Tensor t, Tensor freqs, bool interleaved) -> Tensor", reference_fwd, fake_fwd,
           native=("cpu", "cuda"), npu=npu_fwd, backward=backward, setup_context=setup_context),
    OpSpec("rotary_pos_emb_bwd", "(Tensor dy, Tensor freqs, bool interleaved) -> Tensor", reference_bwd, fake_bwd,
           native=("cpu", "cuda"), npu=npu_bwd),
)


def rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Megatron's apply_rotary_pos_emb for [s, b, h, d]: rotates the first freqs.shape[-1] channels."""
    ensure(t.device.type)
    return op("rotary_pos_emb_fwd")(t, freqs, bool(interleaved))
