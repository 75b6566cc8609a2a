"""Fused ops side by side in one run: time and effective bandwidth against the device's own copy bandwidth.

python benchmarks/ops.py --device cuda                     # the issue's shapes (DEFAULT_CUDA_SHAPES)
python benchmarks/ops.py --device cuda --hidden 1024 2048 4096 8192 16384 [--tokens 16384]
python benchmarks/ops.py [--tokens 4096] [--hidden 1024 4096] # CPU
options: --dtype float32 bfloat16, --impls (subset of IMPLEMENTATIONS), --ops (subset of the ops), --min-run-time,
--copy-mib, --compile-backend

Implementations: mm_adaptor (`mm_adaptor.ops`), eager (the plain PyTorch composition; for RoPE megatron-core's
own `_apply_rotary_pos_emb_bshd`), torch.compile (of the eager code), torch F.rms_norm, liger (Liger-Kernel's
autograd functions, where importable). Each is first checked against eager (output and input gradients, relative
norm of the difference); a wrong result is reported instead of timed.

Forward runs under no_grad, forward+backward includes autograd. Medians: CUDA events on CUDA, torch.utils.benchmark
elsewhere. GB/s counts the minimum bytes the op must move (the *_min_bytes functions), so it compares every
implementation on the same footing; "% of copy" divides it by the device-to-device copy bandwidth measured in
the same run; "time / mm_adaptor's" above 1: mm_adaptor is faster.
"""

from __future__ import annotations

import argparse
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from _common import copy_bandwidth_gbs, device_median_ms, device_name, package_version, print_columns

import mm_adaptor.ops as ops

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's notes that TE and Apex are missing
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

EPS = 1e-5
IMPLEMENTATIONS = ("mm_adaptor", "eager", "torch.compile", "torch F.rms_norm", "liger")
# (op, shape): rms_norm [T, H]; swiglu [T, F] (input [T, 2F]); rotary_pos_emb [s, b, heads, head dim]
DEFAULT_CUDA_SHAPES = (("rms_norm", (16384, 4096)), ("rms_norm", (16384, 8192)),
                       ("swiglu", (16384, 11008)), ("swiglu", (16384, 14336)),
                       ("rotary_pos_emb", (4096, 4, 32, 128)))
ROTARY_BATCH = 2  # for --hidden: [tokens / 2, 2, hidden / 128, 128]
RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


# ---- minimum bytes each op must read and write: {"fwd": bytes, "fwd+bwd": bytes} ----

def rms_norm_min_bytes(shape, dtype) -> dict[str, int]:
    """x [T, H], weight [H]. Forward reads x and w, writes y and rstd (T fp32).
    Backward reads dy, x, w and rstd, writes dx and dw."""
    tokens, hidden = shape
    e = dtype.itemsize
    fwd = (2 * tokens * hidden + hidden) * e + 4 * tokens
    bwd = (3 * tokens * hidden + 2 * hidden) * e + 4 * tokens
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def swiglu_min_bytes(shape, dtype) -> dict[str, int]:
    """x [T, 2F] -> y [T, F]. Forward reads x, writes y. Backward reads dy [T, F] and x, writes dx [T, 2F]."""
    tokens, ffn = shape
    e = dtype.itemsize
    fwd = 3 * tokens * ffn * e
    bwd = 5 * tokens * ffn * e
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def rotary_pos_emb_min_bytes(shape, dtype) -> dict[str, int]:
    """t [s, b, h, d], freqs [s, 1, 1, d] fp32. Forward reads t and freqs, writes out.
    Backward reads dy and freqs, writes dx."""
    seq, batch, heads, dim = shape
    e = dtype.itemsize
    elements = seq * batch * heads * dim
    freqs = seq * dim * 4
    fwd = 2 * elements * e + freqs
    bwd = 2 * elements * e + freqs
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


MIN_BYTES = {"rms_norm": rms_norm_min_bytes, "swiglu": swiglu_min_bytes, "rotary_pos_emb": rotary_pos_emb_min_bytes}


# ---- eager compositions ----

def eager_rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def aten_rms_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def eager_swiglu(x):
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def eager_rope(t, freqs):
    return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False)


def mm_adaptor_rms_norm(x, w):
    return ops.rms_norm(x, w, EPS)


EAGER = {"rms_norm": eager_rms_norm, "swiglu": eager_swiglu, "rotary_pos_emb": eager_rope}
MM_ADAPTOR = {"rms_norm": mm_adaptor_rms_norm, "swiglu": ops.swiglu, "rotary_pos_emb": ops.rotary_pos_emb}


# ---- one implementation bound to its own copies of a case's inputs ----

@dataclass
class Bound:
    run: Callable  # forward: an output or a tuple of outputs
    leaves: list  # tensors whose gradients the backward computes
    out_grads: list  # one per output
    to_reference: Callable = lambda out: out  # the output in eager's layout
    reference_grads: Callable | None = None  # the input gradients in eager's layout

    def grads(self):
        return self.reference_grads() if self.reference_grads else [t.grad for t in self.leaves]

    def fwd_bwd(self):
        for t in self.leaves:
            t.grad = None
        out = self.run()
        torch.autograd.backward(out if isinstance(out, tuple) else (out,), self.out_grads)


def bind_plain(fn, inputs, grad) -> Bound:
    own = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    return Bound(run=lambda: fn(*own), leaves=[t for t in own if t.requires_grad], out_grads=[grad.clone()])


@dataclass
class Case:
    op: str
    shape: tuple
    dtype: torch.dtype
    inputs: list
    grad: torch.Tensor

    @property
    def label(self) -> str:
        if self.op == "swiglu":
            return f"{self.shape[0]}x(2x{self.shape[1]})"
        return "x".join(map(str, self.shape))


def make_inputs(op, shape, dtype, device):
    def leaf(*size):
        return torch.randn(*size, dtype=dtype, device=device, requires_grad=True)

    if op == "rms_norm":
        tokens, hidden = shape
        return [leaf(tokens, hidden), leaf(hidden)], torch.randn(tokens, hidden, dtype=dtype, device=device)
    if op == "swiglu":
        tokens, ffn = shape
        return [leaf(tokens, 2 * ffn)], torch.randn(tokens, ffn, dtype=dtype, device=device)
    seq, batch, heads, dim = shape
    base = torch.randn(seq, 1, 1, dim // 2, device=device)
    return [leaf(seq, batch, heads, dim), torch.cat([base, base], -1)], torch.randn(seq, batch, heads, dim,
                                                                                   dtype=dtype, device=device)


def sweep_shapes(tokens, hidden_sizes):
    for hidden in hidden_sizes:
        heads, dim = max(1, hidden // 128), min(128, hidden)
        yield "rms_norm", (tokens, hidden)
        yield "swiglu", (tokens, hidden)
        yield "rotary_pos_emb", (max(1, tokens // ROTARY_BATCH), ROTARY_BATCH, heads, dim)


# ---- Liger-Kernel (Triton; CUDA only) ----

LIGER_CALLS = ("LigerRMSNormFunction (casting_mode llama, not in place), LigerFusedGateUpSiLUMulFunction on the "
               "[T, 2F] input (LigerSiLUMulFunction on its two halves where absent), LigerRopeFunction (in place, "
               "[b, s, h, d]: half the heads as q, half as k)")


def liger_binders(device) -> dict:
    """op -> binder, or op -> why Liger cannot run it here."""
    try:
        import torch.distributed.tensor  # noqa: F401  (liger's rms_norm names DTensor on torch >= 2.11)
        from liger_kernel.ops import rms_norm as liger_rms, rope as liger_rope, swiglu as liger_swiglu
    except ImportError as exc:
        why = "not installed" if package_version("liger-kernel") == "not installed" else f"import failed: {exc}"
        return dict.fromkeys(EAGER, why)
    if torch.device(device).type != "cuda":
        return dict.fromkeys(EAGER, "needs CUDA (Triton kernels)")

    def rms_norm(inputs, grad):
        # casting_mode "llama" (rstd in fp32) and in_place=False, as Liger's own Megatron RMSNorm calls it
        return bind_plain(lambda x, w: liger_rms.LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False),
                          inputs, grad)

    def swiglu(inputs, grad):
        fused = getattr(liger_swiglu, "LigerFusedGateUpSiLUMulFunction", None)
        if fused is not None:  # reads gate and up from the one [T, 2F] buffer
            return bind_plain(lambda x: fused.apply(x, False), inputs, grad)
        # older Liger: two tensors; its ensure_contiguous copies both halves of the chunk
        return bind_plain(lambda x: liger_swiglu.LigerSiLUMulFunction.apply(*x.chunk(2, dim=-1)), inputs, grad)

    def rope(inputs, grad):
        return bind_liger_rope(liger_rope.LigerRopeFunction, inputs, grad)

    return {"rms_norm": rms_norm, "swiglu": swiglu, "rotary_pos_emb": rope}


def bind_liger_rope(function, inputs, grad) -> Bound | str:
    """Liger rotates HF's q and k together, in place, in the [b, s, heads, d] layout (passed as [b, heads, s, d]
    views) with cos/sin [1, s, d]. The case's [s, b, h, d] data goes in transposed to [b, s, h, d], its first
    half of the heads as q and the rest as k: the same elements, bytes and rotate-half arithmetic. cos/sin are
    computed from freqs inside the timed call, as the other implementations do (they take freqs)."""
    t, freqs = inputs
    seq, batch, heads, dim = t.shape
    if heads < 2:
        return "needs >= 2 heads (q and k)"
    q_heads = heads // 2
    bshd = t.detach().transpose(0, 1)
    q = bshd[:, :, :q_heads].contiguous().requires_grad_()
    k = bshd[:, :, q_heads:].contiguous().requires_grad_()
    g = grad.transpose(0, 1)
    gq, gk = g[:, :, :q_heads].contiguous().transpose(1, 2), g[:, :, q_heads:].contiguous().transpose(1, 2)

    def reference_layout(q_part, k_part):
        return torch.cat([q_part, k_part], dim=2).transpose(0, 1)

    def run():
        return function.apply(q.transpose(1, 2), k.transpose(1, 2), freqs.cos().view(1, seq, dim),
                              freqs.sin().view(1, seq, dim))

    return Bound(run=run,
                 leaves=[q, k], out_grads=[gq, gk],
                 to_reference=lambda out: reference_layout(out[0].transpose(1, 2), out[1].transpose(1, 2)),
                 reference_grads=lambda: [reference_layout(q.grad, k.grad)])


# ---- running one implementation ----

def relative_difference(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30)).item()


def reference_result(case):
    bound = bind_plain(EAGER[case.op], case.inputs, case.grad)
    bound.fwd_bwd()
    with torch.no_grad():
        out = bound.run()
    return out, bound.grads()


def check(bound, reference, dtype) -> str | None:
    """None when output and input gradients match eager, else what differs. Runs first on the bound copies, as
    some implementations (Liger's RoPE) rotate their inputs in place."""
    ref_out, ref_grads = reference
    out = bound.run()
    reference_layout = bound.to_reference(out).detach().clone()
    torch.autograd.backward(out if isinstance(out, tuple) else (out,), bound.out_grads)
    worst = max([("output", relative_difference(reference_layout, ref_out))] +
                [(f"grad {i}", relative_difference(g, r)) for i, (g, r) in enumerate(zip(bound.grads(), ref_grads))],
                key=lambda item: item[1] if math.isfinite(item[1]) else math.inf)
    if not worst[1] <= RELATIVE_TOLERANCE[dtype]:
        return f"wrong result: {worst[0]} differs from eager by {worst[1]:.1e} (relative norm)"
    return None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:100] if text else ''}".replace("|", "/")


def measure(case, impl, binder, reference, min_run_time, device):
    """{"fwd": ms, "fwd+bwd": ms}, or why not."""
    if isinstance(binder, str):
        return binder
    try:
        bound = binder(case.inputs, case.grad)
        if isinstance(bound, str):
            return bound
        wrong = check(bound, reference, case.dtype)
        if wrong:
            return wrong
        with torch.no_grad():
            bound.run()
            fwd = device_median_ms(bound.run, min_run_time, device)
        bound.fwd_bwd()
        return {"fwd": fwd, "fwd+bwd": device_median_ms(bound.fwd_bwd, min_run_time, device)}
    except Exception as exc:  # noqa: BLE001  (the column says why; the other implementations still run)
        return ("compile failed: " if impl == "torch.compile" else "failed: ") + first_line(exc)


def binders_for(op, impls, liger, backend="inductor"):
    eager = EAGER[op]
    table = {"mm_adaptor": lambda inputs, grad: bind_plain(MM_ADAPTOR[op], inputs, grad),
             "eager": lambda inputs, grad: bind_plain(eager, inputs, grad),
             "torch.compile": lambda inputs, grad: bind_plain(torch.compile(eager, dynamic=False, backend=backend),
                                                              inputs, grad),
             "liger": liger[op]}
    if op == "rms_norm":
        table["torch F.rms_norm"] = lambda inputs, grad: bind_plain(aten_rms_norm, inputs, grad)
    return {name: table[name] for name in impls if name in table}


COLUMNS = ["op", "dtype", "shape", "pass", "implementation", "ms", "GB/s", "% of copy", "time / mm_adaptor's"]


def print_rows(case, results, copy_gbs):
    nbytes = MIN_BYTES[case.op](case.shape, case.dtype)
    for label in ("fwd", "fwd+bwd"):
        ours = results.get("mm_adaptor")
        for impl, result in results.items():
            cells = [case.op, str(case.dtype).removeprefix("torch."), case.label, label, impl]
            if isinstance(result, str):
                cells += [result, "", "", ""]
            else:
                ms = result[label]
                gbs = nbytes[label] / (ms * 1e-3) / 1e9
                ratio = f"{ms / ours[label]:.2f}x" if isinstance(ours, dict) else ""
                cells += [f"{ms:.4g}", f"{gbs:.4g}", f"{100 * gbs / copy_gbs:.1f}%", ratio]
            print("| " + " | ".join(cells) + " |", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, help="for --hidden (default 4096 on the CPU, 16384 on CUDA)")
    parser.add_argument("--hidden", type=int, nargs="+",
                        help="sweep hidden sizes at --tokens (CPU default 1024 4096; CUDA default: the issue's shapes)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--impls", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--ops", nargs="+", default=list(MIN_BYTES), choices=list(MIN_BYTES), help="default: all")
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per measurement")
    parser.add_argument("--copy-mib", type=int, help="copy-bandwidth buffer (default 1024 on CUDA, 256 elsewhere)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile's backend (aot_eager: no codegen)")
    args = parser.parse_args(argv)
    device_type = torch.device(args.device).type
    on_cuda = device_type == "cuda"
    if args.hidden is None and on_cuda:
        shapes = list(DEFAULT_CUDA_SHAPES)
    else:
        shapes = list(sweep_shapes(args.tokens or (16384 if on_cuda else 4096), args.hidden or [1024, 4096]))
    shapes = [(op, shape) for op, shape in shapes if op in args.ops]
    impls = ["mm_adaptor"] + [name for name in args.impls if name != "mm_adaptor"]

    native = ops.library.ensure(device_type)
    copy_bytes = (args.copy_mib or (1024 if on_cuda else 256)) << 20
    copy_gbs = copy_bandwidth_gbs(args.device, copy_bytes, args.min_run_time)
    liger = liger_binders(args.device)
    print(f"# {device_name(args.device)}; torch {torch.__version__}, triton {package_version('triton')}, "
          f"liger-kernel {package_version('liger-kernel')}; mm_adaptor ops on {device_type}: "
          f"{'native' if native.get('native') else 'reference fallback'} ({native.get('why', '')})")
    if not any(isinstance(binder, str) for binder in liger.values()):
        print(f"# liger: {LIGER_CALLS}")
    print(f"# device-to-device copy of {copy_bytes >> 20} MiB: {copy_gbs:.4g} GB/s (2 x bytes / time); "
          f"medians of {'CUDA events' if on_cuda else 'torch.utils.benchmark'}, {args.min_run_time} s each"
          + ("" if args.compile_backend == "inductor" else f"; torch.compile backend {args.compile_backend}"))
    print_columns(COLUMNS)
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for op, shape in shapes:
            torch._dynamo.reset()
            inputs, grad = make_inputs(op, shape, dtype, args.device)
            case = Case(op, shape, dtype, inputs, grad)
            reference = reference_result(case)
            results = {impl: measure(case, impl, binder, reference, args.min_run_time, args.device)
                       for impl, binder in binders_for(op, impls, liger, args.compile_backend).items()}
            print_rows(case, results, copy_gbs)
            del case, inputs, grad, reference, results
            if on_cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
