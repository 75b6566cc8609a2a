"""Plain-PyTorch references: the ground truth in tests, and the fallback when no native build is possible.
Same signatures and results as the native kernels (fp32 accumulation, outputs in the input dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _acc(t):
    """Accumulation dtype: float64 for float64 inputs, float32 otherwise (as the kernels do)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def rms_norm_fwd(x, weight, eps):
    xf = x.to(_acc(x))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (xf * rstd * weight.to(xf.dtype)).to(x.dtype)
    return y, rstd.reshape(-1)


def rms_norm_bwd(dy, x, weight, rstd):
    n = x.shape[-1]
    acc = _acc(x)
    xf, dyf, wf = x.to(acc).reshape(-1, n), dy.to(acc).reshape(-1, n), weight.to(acc)
    r = rstd.to(acc).reshape(-1, 1)
    xhat = xf * r
    dw = (dyf * xhat).sum(0)
    mean_dot = (dyf * wf * xhat).sum(-1, keepdim=True) / n
    dx = r * (dyf * wf - xhat * mean_dot)
    return dx.reshape(x.shape).to(x.dtype), dw.to(weight.dtype)


def swiglu_fwd(x):
    a, b = x.to(_acc(x)).chunk(2, dim=-1)
    return (F.silu(a) * b).to(x.dtype)


def swiglu_bwd(dy, x):
    a, b = x.to(_acc(x)).chunk(2, dim=-1)
    g = dy.to(a.dtype)
    sig = torch.sigmoid(a)
    da = g * b * sig * (1 + a * (1 - sig))
    db = g * a * sig
    return torch.cat([da, db], dim=-1).to(x.dtype)


def _pairs(t, rot, interleaved):
    if interleaved:
        return t[..., 0:rot:2], t[..., 1:rot:2]
    return t[..., : rot // 2], t[..., rot // 2: rot]


def _rope(t, freqs, interleaved, backward):
    rot = freqs.shape[-1]
    tf = t.to(_acc(t))
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


def rotary_pos_emb_fwd(t, freqs, interleaved):
    return _rope(t, freqs, interleaved, backward=False)


def rotary_pos_emb_bwd(dy, freqs, interleaved):
    return _rope(dy, freqs, interleaved, backward=True)


def matmul_add_fp32(main_grad, grad_output, input):
    out, inp = grad_output.shape[-1], input.shape[-1]
    acc = torch.float64 if grad_output.dtype == torch.float64 else torch.float32
    main_grad.add_((grad_output.reshape(-1, out).to(acc).t() @ input.reshape(-1, inp).to(acc)).to(main_grad.dtype))


def _segments(tokens_per_expert, tokens):
    counts = [int(c) for c in tokens_per_expert.tolist()]
    if sum(counts) != tokens:
        raise RuntimeError(f"grouped_matmul: tokens_per_expert sums to {sum(counts)} but x has {tokens} rows")
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return list(zip(starts[:-1], counts))


def grouped_matmul_fwd(x, weights, tokens_per_expert):
    y = x.new_empty((x.shape[0], weights.shape[2]))
    for e, (start, count) in enumerate(_segments(tokens_per_expert, x.shape[0])):
        y[start:start + count] = x[start:start + count] @ weights[e]
    return y


def grouped_matmul_bwd(dy, x, weights, tokens_per_expert):
    dx, dw = torch.empty_like(x), torch.zeros_like(weights)
    for e, (start, count) in enumerate(_segments(tokens_per_expert, x.shape[0])):
        dx[start:start + count] = dy[start:start + count] @ weights[e].t()
        dw[e] = x[start:start + count].t() @ dy[start:start + count]
    return dx, dw
