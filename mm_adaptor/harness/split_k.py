"""The rounding perturbation the harness calibrates with: every matrix product summed in parts along its inner
dimension (two halves by default). Importing this module registers it as a feature (`--calibration-split-k`),
which is how the training ranks get it (MM_ADAPTOR_FEATURE_MODULES); it is never registered otherwise.

Batched products (attention's scores and context: torch.bmm, torch.baddbmm) are split in their backward too: the
gradient of a split forward is otherwise the native backward (each gradient's inner dimension is not the one split),
and attention's backward would keep its own rounding in the noise run while a fused attention kernel changes it.
Megatron's linear layers already run their backward GEMMs through torch.matmul, which is split.
"""

from __future__ import annotations

from mm_adaptor.core.features import Feature, Flag, Tolerance, register
from mm_adaptor.core.patching import PatchSet

FLAG = "--calibration-split-k"
PARTS_FLAG = "--calibration-split-k-parts"
MODULE = __name__


def _split_k(matmul, parts):
    def split(a, b, *args, **kwargs):
        if args or kwargs or a.dim() < 2 or b.dim() < 2 or a.shape[-1] < 2:
            return matmul(a, b, *args, **kwargs)
        cut = max(1, a.shape[-1] // parts)
        return matmul(a[..., :cut], b[..., :cut, :]) + matmul(a[..., cut:], b[..., cut:, :])

    return split


def _split_k_bmm(bmm, parts):
    """torch.bmm split in the forward and in both backward products."""
    import torch

    split = _split_k(bmm, parts)

    class SplitBmm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return split(a, b)

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            grad_a = split(grad, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None
            grad_b = split(a.transpose(1, 2), grad) if ctx.needs_input_grad[1] else None
            return grad_a, grad_b

    def split_bmm(a, b, *args, **kwargs):
        if args or kwargs or a.dim() != 3 or b.dim() != 3:
            return bmm(a, b, *args, **kwargs)
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            return SplitBmm.apply(a, b)
        return split(a, b)

    return split_bmm


def _split_k_baddbmm(baddbmm, bmm, parts):
    split_bmm = _split_k_bmm(bmm, parts)

    def split(input, batch1, batch2, *, beta=1, alpha=1, out=None):
        if out is not None:
            return baddbmm(input, batch1, batch2, beta=beta, alpha=alpha, out=out)
        product = split_bmm(batch1, batch2)
        if alpha != 1:
            product = product * alpha
        return product if beta == 0 else input * beta + product

    return split


def _split_k_linear(matmul, parts):
    split_matmul = _split_k(matmul, parts)

    def split(input, weight, bias=None):
        out = split_matmul(input, weight.t())
        return out if bias is None else out + bias

    return split


def perturbation_patches(parts: int = 2) -> PatchSet:
    import torch

    ps = PatchSet("calibration-split-k")
    matmul, bmm = torch.matmul, torch.bmm
    ps.replace("torch.matmul", _split_k(matmul, parts))
    ps.replace("torch.Tensor.matmul", _split_k(torch.Tensor.matmul, parts))
    ps.replace("torch.Tensor.__matmul__", _split_k(torch.Tensor.__matmul__, parts))
    ps.replace("torch.bmm", _split_k_bmm(bmm, parts))
    ps.replace("torch.baddbmm", _split_k_baddbmm(torch.baddbmm, bmm, parts))
    ps.replace("torch.nn.functional.linear", _split_k_linear(matmul, parts))
    return ps


@register
class SplitKPerturbation(Feature):
    name = "calibration-split-k"
    description = ("harness calibration only: every matrix product summed in parts along its inner dimension "
                   "(the same math, Megatron's own rounding noise)")
    flags = (Flag(FLAG, description),
             Flag(PARTS_FLAG, "the first part is 1/N of the inner dimension (default 2)", type=int, default=2))
    tolerance = Tolerance(exact=False, why="a different rounding of the same math")

    def patch_sets(self, options):
        return [perturbation_patches(getattr(options, "calibration_split_k_parts", 2))]
