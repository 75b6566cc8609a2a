"""rotary_pos_emb: Megatron's apply_rotary_pos_emb for [s, b, h, d], rotate-half or interleaved, partial rotary.
Native kernels: csrc/cpu/rotary_pos_emb.cpp, csrc/cuda/; NPU: torch_npu.npu_rotary_mul and npu_rotary_mul_backward,
rotary_mode 'half' or 'interleave' (the reference where torch_npu documents no kernel: see npu_serves)."""

from __future__ import annotations

import torch

from mm_adaptor.ops.library import OpSpec, accumulation_dtype, ensure, op, register


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


def npu_serves(t, freqs, interleaved) -> bool:
    """torch_npu's npu_rotary_mul: 3-D or 4-D float16/bfloat16/float32, D even and below 896; in interleave mode the
    cos/sin tensors broadcast over all leading dims but one (megatron's [s, 1, 1, rot] does)."""
    rot = freqs.shape[-1]
    return (t.dtype in NPU_DTYPES and t.dim() in (3, 4) and freqs.dim() == t.dim() and rot % 2 == 0 and 0 < rot < 896
            and (not interleaved or sum(s != 1 for s in freqs.shape[:-1]) <= 1))


def _npu_rotary(t, freqs, interleaved, backward):
    import torch_npu

    rot = freqs.shape[-1]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    mode = "interleave" if interleaved else "half"
    head = t[..., :rot]
    if backward:  # cos and sin need no gradient, so the kernel gets no x (op-plugin's RotaryMulBackward): `self`
        rotated = torch_npu.npu_rotary_mul_backward(head, head, cos, sin, mode)[0]  # only gives dx its dtype
    else:
        rotated = torch_npu.npu_rotary_mul(head, cos, sin, mode)
    return rotated if rot == t.shape[-1] else torch.cat([rotated, t[..., rot:]], dim=-1)


def npu_fwd(t, freqs, interleaved):
    if not npu_serves(t, freqs, interleaved):
        return reference_fwd(t, freqs, interleaved)
    return _npu_rotary(t, freqs, interleaved, backward=False)


def npu_bwd(dy, freqs, interleaved):
    if not npu_serves(dy, freqs, interleaved):
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
