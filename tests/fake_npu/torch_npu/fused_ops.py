"""FAKE torch_npu fused ops (tests only): npu_grouped_matmul, npu_rms_norm, npu_swiglu, npu_rotary_mul and their
backward ops, as `torch.ops.npu.*` operators with torch_npu's schemas, the argument rules its documentation states,
and the autograd wiring its derivatives.yaml declares, computed by reference math in float32. NOT Ascend kernels:
these numerics say nothing about the real ones.

Source (read for the facts, nothing copied): Ascend/op-plugin at commit 517f2e7d (2026-08-21, master after tag
26.1.0): op_plugin/config/op_plugin_functions.yaml (schemas), op_plugin/config/derivatives.yaml (which backward op
each forward's gradient calls), op_plugin/ops/opapi/{RmsNorm,RmsNormBackward}KernelOpApi.cpp (rstd and dgamma are
float32; rstd keeps x's leading dims and 1 for gamma's), RotaryMulBackwardKernelNpuOpApi.cpp,
GroupedMatmulKernelNpuOpApi.cpp, docs/zh/custom_APIs/torch_npu/*.md (dtypes, shapes, layouts, limits).

MM_ADAPTOR_FAKE_NPU_OP_PLUGIN=6.0.0|7.0.0|7.1.0 imitates that op-plugin branch for npu_rotary_mul and
npu_grouped_matmul instead (its yaml schemas, its docs/context pages, its kernel's checks): 6.0.0 has the
three-argument npu_rotary_mul (rotate-half, D = 128) and only the int[] group_list; 7.0.0 adds rotary_mode and the
tensor group_list; 7.1.0 adds tuning_config and refuses group_type 2, which 7.2.0 added.
"""

from __future__ import annotations

import math
import os

import torch

from torch_npu.ops import CALLS

OP_PLUGIN_ENV = "MM_ADAPTOR_FAKE_NPU_OP_PLUGIN"
OP_PLUGIN = os.environ.get(OP_PLUGIN_ENV) or "master"
if OP_PLUGIN not in ("6.0.0", "7.0.0", "7.1.0", "master"):
    raise RuntimeError(f"(FAKE torch_npu) {OP_PLUGIN_ENV}={OP_PLUGIN!r}: 6.0.0, 7.0.0, 7.1.0 or unset (master)")
ROTARY_MODE = OP_PLUGIN != "6.0.0"  # npu_rotary_mul's rotary_mode argument: op-plugin 7.0.0 on

_ROTARY = {
    "master": ("npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) "
               "-> Tensor"),
    "7": "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor",
    "6.0.0": "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2) -> Tensor",
}
_ROTARY_BACKWARD = {
    "6.0.0": "npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2) -> (Tensor, Tensor, Tensor)",
    "7": ("npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') "
          "-> (Tensor, Tensor, Tensor)"),
}
_GMM_HEAD = ("Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, Tensor[]? offset=None, "
             "Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None")
_GMM_ACT = ("Tensor[]? activation_input=None, Tensor[]? activation_quant_scale=None, "
            "Tensor[]? activation_quant_offset=None")


def _gmm_schema(overload, group_list, group_type, tail):
    return (f"npu_grouped_matmul{overload}({_GMM_HEAD}, Tensor[]? per_token_scale=None, {group_list} group_list=None, "
            f"{_GMM_ACT}, int? split_item=0, int? group_type={group_type}, int? group_list_type=0, int? act_type=0, "
            f"{tail}) -> Tensor[]")


_GMM = {  # overload -> schema, per op-plugin branch
    "6.0.0": {"": f"npu_grouped_matmul({_GMM_HEAD}, int[]? group_list=None, int? split_item=0, "
                  "ScalarType? output_dtype=None) -> Tensor[]"},
    "7.0.0": {"": _gmm_schema("", "Tensor?", "-1", "ScalarType? output_dtype=None"),
              "List": _gmm_schema(".List", "int[]?", "-1", "ScalarType? output_dtype=None")},
    "7.1.0": {"": _gmm_schema("", "Tensor?", "None", "int[]? tuning_config=None, ScalarType? output_dtype=None"),
              "List": _gmm_schema(".List", "int[]?", "None", "ScalarType? output_dtype=None")},
    "master": {"": _gmm_schema("", "Tensor?", "None", "int[]? tuning_config=None, int? output_dtype=None, "
                               "int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
                               "int? per_token_scale_dtype=None"),
               "List": _gmm_schema(".List", "int[]?", "None", "ScalarType? output_dtype=None")},
}[OP_PLUGIN]
_release = OP_PLUGIN if OP_PLUGIN in ("6.0.0", "master") else "7"
SCHEMAS = {
    "npu_rms_norm": "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_rms_norm_backward": "npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) "
                             "-> (Tensor, Tensor)",
    "npu_swiglu": "npu_swiglu(Tensor self, int dim=-1) -> Tensor",
    "npu_swiglu_backward": "npu_swiglu_backward(Tensor grad_output, Tensor self, int dim=-1) -> Tensor",
    "npu_rotary_mul": _ROTARY[_release],
    "npu_rotary_mul_backward": _ROTARY_BACKWARD["6.0.0" if OP_PLUGIN == "6.0.0" else "7"],
}
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
LIB = torch.library.Library("npu", "DEF")  # noqa: TOR901 (the fake's own namespace, as torch_npu's is "npu")


def _count(name):
    CALLS[name] = CALLS.get(name, 0) + 1


def _check(ok, message):
    if not ok:
        raise RuntimeError(f"(FAKE torch_npu) {message}")


# --- npu_rms_norm ---------------------------------------------------------------------------------------------

def _rms_shapes(x, gamma):
    _check(x.dtype in FLOATS, f"npu_rms_norm: self dtype {x.dtype} is not float16, bfloat16 or float32")
    _check(gamma.dtype in (x.dtype, torch.float32), f"npu_rms_norm: gamma {gamma.dtype} with self {x.dtype}")
    _check(x.dim() >= gamma.dim(), "npu_rms_norm: the gamma shape should not be bigger than self shape")
    _check(tuple(x.shape[x.dim() - gamma.dim():]) == tuple(gamma.shape),
           f"npu_rms_norm: gamma shape {tuple(gamma.shape)} is not self's trailing shape {tuple(x.shape)}")
    lead = x.dim() - gamma.dim()
    return (*x.shape[:lead], *([1] * gamma.dim())), tuple(range(lead, x.dim()))


def rms_norm(x, gamma, epsilon=1e-6):
    _count("npu_rms_norm")
    rstd_shape, dims = _rms_shapes(x, gamma)
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon) if dims else torch.rsqrt(xf.pow(2) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd.reshape(rstd_shape)


def rms_norm_backward(dy, x, gamma, rstd):
    _count("npu_rms_norm_backward")
    rstd_shape, dims = _rms_shapes(x, gamma)
    _check(rstd.dtype == torch.float32 and tuple(rstd.shape) == tuple(rstd_shape),
           f"npu_rms_norm_backward: rstd must be float32 of shape {tuple(rstd_shape)}, got {rstd.dtype} "
           f"{tuple(rstd.shape)}")
    xf, dyf, gf = x.float(), dy.float(), gamma.float()
    xhat = xf * rstd
    lead = tuple(range(x.dim() - gamma.dim()))
    dgamma = (dyf * xhat).sum(lead) if lead else dyf * xhat
    n = gamma.numel()
    mean_dot = (dyf * gf * xhat).sum(dims, keepdim=True) / n
    return (rstd * (dyf * gf - xhat * mean_dot)).to(x.dtype), dgamma


def _rms_meta(x, gamma, epsilon=1e-6):
    rstd_shape, _ = _rms_shapes(x, gamma)
    return torch.empty_like(x), x.new_empty(rstd_shape, dtype=torch.float32)


def _rms_bwd_meta(dy, x, gamma, rstd):
    return torch.empty_like(x), gamma.new_empty(gamma.shape, dtype=torch.float32)


def _rms_setup(ctx, inputs, output):
    x, gamma, _eps = inputs
    ctx.save_for_backward(x, gamma, output[1])


def _rms_autograd(ctx, grad, _grad_rstd):
    x, gamma, rstd = ctx.saved_tensors
    dx, dgamma = torch.ops.npu.npu_rms_norm_backward(grad, x, gamma, rstd)
    return dx, dgamma.to(gamma.dtype), None


# --- npu_swiglu -----------------------------------------------------------------------------------------------

def _swiglu_check(x, dim):
    _check(x.dtype in FLOATS, f"npu_swiglu: dtype {x.dtype} is not float16, bfloat16 or float32")
    _check(1 <= x.dim() <= 8, f"npu_swiglu: {x.dim()} dims (1 to 8 supported)")
    _check(-x.dim() <= dim < x.dim(), f"npu_swiglu: dim {dim} out of range for {x.dim()} dims")
    _check(x.shape[dim] % 2 == 0, f"npu_swiglu: size {x.shape[dim]} of dim {dim} is not even")
    _check(x.is_contiguous(), "npu_swiglu: non-contiguous input is not supported")
    _check(x.numel() > 0, "npu_swiglu: empty input is not supported")


def swiglu(x, dim=-1):
    _count("npu_swiglu")
    _swiglu_check(x, dim)
    a, b = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def swiglu_backward(grad_output, x, dim=-1):
    _count("npu_swiglu_backward")
    _swiglu_check(x, dim)
    a, b = x.float().chunk(2, dim=dim)
    g = grad_output.float()
    sig = torch.sigmoid(a)
    return torch.cat([g * b * sig * (1 + a * (1 - sig)), g * a * sig], dim=dim).to(x.dtype)


def _swiglu_meta(x, dim=-1):
    shape = list(x.shape)
    shape[dim] //= 2
    return x.new_empty(shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.dim = inputs[1]


def _swiglu_autograd(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.npu.npu_swiglu_backward(grad, x, ctx.dim), None


# --- npu_rotary_mul -------------------------------------------------------------------------------------------
# The limits of the docs' jit_compile=False case (Atlas A2/A3); 6.0.0 documents one case: 4-D, D = 128, B and N <=
# 1000, broadcast axes <= 1024 elements, and for BNSD B*N <= 8*S. The layout is read from r1's shape; where several
# documented layouts fit, each one's limits apply.

_LAYOUTS = {3: {"TND": (0, None, 1)}, 4: {"BNSD": (2, 0, 1), "BSND": (1, 0, 2), "SBND": (0, 1, 2)}}  # S, B, N axes


def _rotate(x, mode):
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _rotary_layouts(x, r1, mode):
    """(layout, B, N, S) for each documented layout whose r1 shapes include r1's: r1 is full (x's size) on the axes
    of one of them and 1 elsewhere; half mode takes r1 as 11SD, B1SD or BNSD (and the like), interleave 11SD only."""
    lead, r_lead = x.shape[:-1], r1.shape[:-1]
    fits = []
    for layout, (s, b, n) in _LAYOUTS[x.dim()].items():
        fulls = [{s}] if mode == "interleave" or not ROTARY_MODE else [{s}, {s, b} - {None}, {s, b, n} - {None}]
        if any(all(r_lead[i] == (lead[i] if i in full else 1) for i in range(len(lead))) for full in fulls):
            fits.append((layout, 1 if b is None else lead[b], lead[n], lead[s]))
    _check(fits, f"npu_rotary_mul: r1/r2 of shape {tuple(r1.shape)} fit no documented layout of input "
                 f"{tuple(x.shape)} ({mode} mode)")
    return fits


def _rotary_check(x, r1, r2, mode, rotate=None, backward=False):
    _check(mode in ("half", "interleave"), f"npu_rotary_mul: rotary_mode {mode!r} (half or interleave)")
    _check(rotate is None, "npu_rotary_mul: the FAKE implements no `rotate` matrix")
    dims = (3, 4) if ROTARY_MODE else (4,)
    for name, t in (("input", x), ("r1", r1), ("r2", r2)):
        _check(t.dim() in dims, f"npu_rotary_mul: {name} has {t.dim()} dims ({' or '.join(map(str, dims))} supported)")
        _check(t.dtype in FLOATS, f"npu_rotary_mul: {name} dtype {t.dtype}")
    d = x.shape[-1]
    if ROTARY_MODE:
        _check(d % 2 == 0 and d < 896, f"npu_rotary_mul: D={d} must be even and below 896")
    else:
        _check(d == 128, f"npu_rotary_mul: D={d}, op-plugin 6.0.0 documents D = 128")
    _check(r1.shape == r2.shape and r1.dim() == x.dim() and r1.shape[-1] == d,
           "npu_rotary_mul: r1 and r2 must match, have input's dims and end in D")
    for name, t in (("r1", r1), ("r2", r2)):
        _check(t.numel() == 0 or float(t.detach().abs().max()) <= 1, f"npu_rotary_mul: {name} outside [-1, 1]")
    for layout, b, n, s in _rotary_layouts(x, r1, mode):
        where = f"npu_rotary_mul ({layout}, B={b}, N={n})"
        if not ROTARY_MODE:
            broadcast = math.prod(x.shape[i] for i in range(x.dim() - 1) if r1.shape[i] == 1)
            _check(b <= 1000 and n <= 1000, f"{where}: B and N must be <= 1000")
            _check(broadcast <= 1024, f"{where}: the broadcast axes hold {broadcast} elements, more than 1024")
            _check(layout != "BNSD" or b * n <= 8 * s, f"{where}: B*N > 8*S is not supported for BNSD")
        elif mode == "half":
            _check(b < 1000 and n < 1000, f"{where}: half mode needs B < 1000 and N < 1000")
            # cos/sin gradients: op-plugin < 7.1.0 and the aclop path always compute them, and so does the fake
            _check(not backward or b * n <= 1024, f"{where}: B*N must be <= 1024 when the cos/sin gradients are "
                                                  "computed (npu_rotary_mul_backward)")
        else:
            _check(b * n < 1000, f"{where}: interleave mode needs B*N < 1000")


def rotary_mul(x, r1, r2, rotary_mode="half", rotate=None):
    _count(f"npu_rotary_mul:{rotary_mode}")
    _rotary_check(x, r1, r2, rotary_mode, rotate)
    xf = x.float()
    return (xf * r1.float() + _rotate(xf, rotary_mode) * r2.float()).to(x.dtype)


def _reduce_to(t, shape):
    dims = tuple(i for i, (a, b) in enumerate(zip(t.shape, shape)) if b == 1 and a != 1)
    return t.sum(dims, keepdim=True) if dims else t


def _unrotate(z, mode):
    """The transpose of _rotate: sum_i g_i * rotate(x)_i = sum_j x_j * unrotate(g)_j."""
    return -_rotate(z, mode)


def rotary_mul_backward(grad, x, r1, r2, rotary_mode="half"):
    _count(f"npu_rotary_mul_backward:{rotary_mode}")
    _rotary_check(x, r1, r2, rotary_mode, backward=True)
    g, xf = grad.float(), x.float()
    dx = (g * r1.float() + _unrotate(g * r2.float(), rotary_mode)).to(x.dtype)
    dr1 = _reduce_to(g * xf, r1.shape).to(x.dtype)
    dr2 = _reduce_to(g * _rotate(xf, rotary_mode), r2.shape).to(x.dtype)
    return dx, dr1, dr2


def _rotary_meta(x, r1, r2, rotary_mode="half", rotate=None):
    return torch.empty_like(x)


def _rotary_bwd_meta(grad, x, r1, r2, rotary_mode="half"):
    return torch.empty_like(x), torch.empty_like(r1, dtype=x.dtype), torch.empty_like(r2, dtype=x.dtype)


def _rotary_setup(ctx, inputs, output):
    x, r1, r2 = inputs[:3]
    ctx.save_for_backward(x, r1, r2)
    ctx.mode, ctx.extra = (inputs[3] if len(inputs) > 3 else "half"), len(inputs) - 3


def _rotary_autograd(ctx, grad):
    x, r1, r2 = ctx.saved_tensors
    mode = (ctx.mode,) if ROTARY_MODE else ()
    dx, dr1, dr2 = torch.ops.npu.npu_rotary_mul_backward(grad, x, r1, r2, *mode)
    return (dx, dr1, dr2, *([None] * ctx.extra))


# --- npu_grouped_matmul ---------------------------------------------------------------------------------------
# The non-quantised forms without bias: one x with a tensor group_list (group_type 0: m-axis groups over a 3-D
# weight or a weight list; 2: k-axis groups, op-plugin 7.2.0 on), one x with an int[] group_list, or lists of x and
# weight (group_type -1). Rules from the docs' parameter and scenario tables and the kernel's own checks.

INNER_LIMIT = 65536  # the last dim of every x and weight tensor stays below it
GMM_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _gmm_check(ok, message):
    _check(ok, f"npu_grouped_matmul: {message}")


def _gmm_ends(group_list, group_list_type, total, tensor_form):
    """Each group's end along the grouped axis, checked as documented."""
    if tensor_form:
        _gmm_check(group_list.dim() == 1 and group_list.dtype == torch.int64,
                   f"a tensor group_list must be 1-D int64, got {group_list.dtype} {tuple(group_list.shape)}")
        values = [int(v) for v in group_list.cpu().tolist()]
        _gmm_check(all(v >= 0 for v in values), f"group_list must be non-negative, got {values}")
        if group_list_type == 0:
            _gmm_check(all(b >= a for a, b in zip(values, values[1:])),
                       f"group_list_type=0 takes cumulative sums (non-decreasing), got {values}")
            ends = values
        else:
            _gmm_check(len(values) != 1, "a group_list_type=1 group_list (counts) cannot have length 1")
            ends = [sum(values[:i + 1]) for i in range(len(values))]
    else:
        values = list(group_list)
        _gmm_check(len(values) != 1 and all(v >= 0 for v in values) and all(b > a for a, b in zip(values, values[1:])),
                   f"a List[int] group_list must be non-negative and strictly increasing, length != 1, got {values}")
        ends = values
    _gmm_check(bool(ends) and ends[-1] == total,
               f"group_list must end at the grouped axis' size {total}, got {ends[-1] if ends else None}")
    return [0, *ends]


def _plain_or_transposed(w):
    return w.is_contiguous() or w.transpose(-1, -2).is_contiguous()


def grouped_matmul(x, weight, **kw):
    tensor_form = isinstance(kw.get("group_list"), torch.Tensor)
    defaults = {"group_type": -1 if OP_PLUGIN == "7.0.0" else None, "group_list_type": 0, "act_type": 0,
                "split_item": 0}
    group_list = kw.get("group_list")
    group_type, group_list_type, act_type, split_item = (kw.get(k, v) for k, v in defaults.items())
    CALLS["npu_grouped_matmul"] = CALLS.get("npu_grouped_matmul", 0) + 1
    CALLS[f"npu_grouped_matmul:group_type={group_type}"] = CALLS.get(f"npu_grouped_matmul:group_type={group_type}",
                                                                      0) + 1
    unsupported = ("bias", "scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale",
                   "activation_input", "activation_quant_scale", "activation_quant_offset", "tuning_config")
    if any(kw.get(k) for k in unsupported) or kw.get("output_dtype") not in (None, x[0].dtype) or act_type:
        raise NotImplementedError("npu_grouped_matmul (FAKE): only the non-quantised form without bias or activation")
    _gmm_check(len(x) > 0 and len(weight) > 0 and len(x) <= 128 and len(weight) <= 128,
               "x and weight are lists of 1 to 128 tensors")
    _gmm_check(split_item in (0, 1, 2, 3), f"split_item {split_item} (0, 1, 2 or 3)")
    if group_list is not None and not tensor_form:  # the .List overload, or op-plugin 6.0.0
        _gmm_check(group_type in (None, defaults["group_type"]) and group_list_type == 0,
                   "with a List[int] group_list, group_type and group_list_type take their defaults (they describe "
                   "a tensor group_list)")
    elif OP_PLUGIN != "6.0.0":
        _gmm_check(group_type is not None, "Requires manual passing group_type, current is None")
        allowed = (-1, 0, 2) if OP_PLUGIN == "master" else (-1, 0)
        _gmm_check(group_type in allowed, f"group_type currently only support {allowed}, current value is "
                                          f"{group_type}")
        _gmm_check(group_list_type in (0, 1), f"group_list_type {group_list_type}: 2 is for int8 x and weight only")
    for t in (*x, *weight):
        _gmm_check(t.dtype in GMM_FLOATS and t.dtype == x[0].dtype,
                   f"x and weight take float16, bfloat16 or float32, the same for both; got {t.dtype} with "
                   f"{x[0].dtype}")
    if x[0].dtype == torch.float32 and tensor_form:
        _gmm_check(len(x) == 1 and len(weight) == 1 and split_item in (2, 3),
                   "float32 only with x, weight and y each a single tensor")
    for t in x:
        _gmm_check(t.shape[-1] < INNER_LIMIT, f"x's last dim {t.shape[-1]} must stay below {INNER_LIMIT}")
    for w in weight:
        _gmm_check(w.dim() in (2, 3) and _plain_or_transposed(w), "each weight is 2-D or 3-D, contiguous or with "
                                                                  "its last two dims transposed")
        last = w.shape[-2] if not w.is_contiguous() else w.shape[-1]
        _gmm_check(last < INNER_LIMIT, f"weight's last dim {last} must stay below {INNER_LIMIT}")
    if group_list is None:  # one group per (x, weight) pair
        _gmm_check(len(x) == len(weight) and split_item in (0, 1) and group_type in (None, -1),
                   "without group_list: as many x as weight tensors, split_item 0 or 1, group_type -1")
        return [xi @ wi for xi, wi in zip(x, weight)]
    _gmm_check(len(x) == 1 and x[0].dim() == 2, "the FAKE implements group_list with one 2-D x")
    x0 = x[0]
    if tensor_form:
        _gmm_check(group_list.device == x0.device, "group_list must be on x's device")
    if group_type == 2:  # k-axis groups: y[e] = x[:, k of e] @ weight[k of e]
        _gmm_check(len(weight) == 1 and weight[0].dim() == 2 and split_item in (2, 3),
                   "group_type=2 takes one 2-D weight and split_item 2 or 3")
        _gmm_check(x0.t().is_contiguous(), "group_type=2 takes x laid out as [K, M] (its transpose contiguous)")
        w = weight[0]
        _gmm_check(x0.shape[1] == w.shape[0], f"x {tuple(x0.shape)} and weight {tuple(w.shape)} differ in K")
        bounds = _gmm_ends(group_list, group_list_type, x0.shape[1], tensor_form)
        out = torch.stack([x0[:, a:b] @ w[a:b] for a, b in zip(bounds, bounds[1:])])
        # an empty group's block is not documented: NaN here, as uninitialised memory could hold
        empty = torch.tensor([a == b for a, b in zip(bounds, bounds[1:])], device=out.device)
        return [torch.where(empty.view(-1, 1, 1), float("nan"), out)]
    weights = list(weight[0].unbind(0)) if len(weight) == 1 and weight[0].dim() == 3 else list(weight)
    if tensor_form:
        _gmm_check(len(weight) == 1 and weight[0].dim() == 3 or all(w.dim() == 2 for w in weight),
                   "one 3-D weight or a list of 2-D weights")
        _gmm_check(len(group_list) == len(weights) and len(group_list) <= (1024 if len(weight) == 1 else 128),
                   f"group_list has {len(group_list)} entries for {len(weights)} weights (at most 1024 with one 3-D "
                   "weight, 128 with a list)")
        _gmm_check(split_item in (2, 3), "group_type=0 with a tensor group_list takes split_item 2 or 3")
        _gmm_check(x0.is_contiguous(), "x cannot be transposed")
    else:
        _gmm_check(all(w.dim() == 2 for w in weight) and len(group_list) == len(weights),
                   "a List[int] group_list takes 2-D weights, one per group")
    _gmm_check(all(w.shape[0] == x0.shape[1] for w in weights), f"x {tuple(x0.shape)} and the weights differ in K")
    bounds = _gmm_ends(group_list, group_list_type, x0.shape[0], tensor_form)
    outputs = [x0[a:b] @ w for (a, b), w in zip(zip(bounds, bounds[1:]), weights)]
    if split_item in (2, 3):
        _gmm_check(len({w.shape[1] for w in weights}) == 1, "split_item 2 or 3 needs every weight's N equal")
        return [torch.cat(outputs)]
    return outputs


def _define_grouped_matmul(lib):
    for overload, schema in _GMM.items():
        lib.define(schema)
        lib.impl(f"npu_grouped_matmul.{overload}" if overload else "npu_grouped_matmul", grouped_matmul,
                 "PrivateUse1")


KERNELS = {
    "npu_rms_norm": (rms_norm, _rms_meta, (_rms_autograd, _rms_setup)),
    "npu_rms_norm_backward": (rms_norm_backward, _rms_bwd_meta, None),
    "npu_swiglu": (swiglu, _swiglu_meta, (_swiglu_autograd, _swiglu_setup)),
    "npu_swiglu_backward": (swiglu_backward, lambda g, x, dim=-1: torch.empty_like(x), None),
    "npu_rotary_mul": (rotary_mul, _rotary_meta, (_rotary_autograd, _rotary_setup)),
    "npu_rotary_mul_backward": (rotary_mul_backward, _rotary_bwd_meta, None),
}


def define(lib, schemas, kernels) -> None:
    """Each op: its schema, the reference kernel for the npu device, a fake (meta) kernel and its autograd."""
    for name, (kernel, meta, autograd) in kernels.items():
        lib.define(schemas[name])
        lib.impl(name, kernel, "PrivateUse1")
        torch.library.register_fake(f"npu::{name}", meta, lib=lib)
        if autograd is not None:
            torch.library.register_autograd(f"npu::{name}", autograd[0], setup_context=autograd[1], lib=lib)


def register() -> dict:
    define(LIB, SCHEMAS, KERNELS)
    _define_grouped_matmul(LIB)
    return {name: getattr(torch.ops.npu, name) for name in (*KERNELS, "npu_grouped_matmul")}
