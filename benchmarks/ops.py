"""Native ops against their eager PyTorch compositions, side by side in one run.

python benchmarks/ops.py [--tokens 4096] [--hidden 1024 4096] [--dtype float32 bfloat16] [--device cpu]

Forward and forward+backward medians (torch.utils.benchmark); ratio = eager / native (>1: native faster).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from _common import median_ms, print_table_header

import mm_adaptor.ops as ops


def eager_rms_norm(x, w, eps=1e-5):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def aten_rms_norm(x, w, eps=1e-5):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def eager_swiglu(x):
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def eager_rope(t, freqs):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False)



def fwd_bwd(f, inputs, grad):
    def run():
        for t in inputs:
            t.grad = None
        f().backward(grad)

    return run


def cases(tokens, hidden, dtype, device):
    x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(hidden, dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(tokens, hidden, dtype=dtype, device=device)
    yield "rms_norm", [x, w], g, (lambda: ops.rms_norm(x, w)), {"eager": lambda: eager_rms_norm(x, w),
                                                                 "torch F.rms_norm": lambda: aten_rms_norm(x, w)}
    x2 = torch.randn(tokens, 2 * hidden, dtype=dtype, device=device, requires_grad=True)
    yield "swiglu", [x2], g, (lambda: ops.swiglu(x2)), {"eager": lambda: eager_swiglu(x2)}
    heads, dim = hidden // 128, 128
    seq, batch = tokens // 2, 2
    t = torch.randn(seq, batch, heads, dim, dtype=dtype, device=device, requires_grad=True)
    base = torch.randn(seq, 1, 1, dim // 2, device=device)
    freqs = torch.cat([base, base], -1)
    gt = torch.randn_like(t)
    yield "rotary_pos_emb", [t], gt, (lambda: ops.rotary_pos_emb(t, freqs)), {"eager": lambda: eager_rope(t, freqs)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--min-run-time", type=float, default=1.0)
    args = parser.parse_args(argv)
    ops.library.ensure(args.device)
    print_table_header(f"{args.tokens} tokens, device {args.device}",
                       ["op", "dtype", "hidden", "pass", "native ms", "compared with", "its ms", "ratio"])
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for hidden in args.hidden:
            for name, inputs, grad, native, others in cases(args.tokens, hidden, dtype, args.device):
                with torch.no_grad():
                    n_fwd = median_ms(native, args.min_run_time)
                    o_fwd = {k: median_ms(f, args.min_run_time) for k, f in others.items()}
                n_fb = median_ms(fwd_bwd(native, inputs, grad), args.min_run_time)
                o_fb = {k: median_ms(fwd_bwd(f, inputs, grad), args.min_run_time) for k, f in others.items()}
                for label, n, table in (("fwd", n_fwd, o_fwd), ("fwd+bwd", n_fb, o_fb)):
                    for other, ms in table.items():
                        print(f"| {name} | {dtype_name} | {hidden} | {label} | {n:.3f} | {other} | {ms:.3f} | "
                              f"{ms / n:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
