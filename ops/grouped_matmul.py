"""grouped_matmul: MoE expert GEMMs over token-sorted rows, y[rows of e] = x[rows of e] @ weights[e].
Native kernels: csrc/common/grouped_matmul.cpp (ATen GEMMs, in every device's library); NPU: npu_grouped_matmul
forward and backward (see npu_fwd), one local expert as a plain matmul."""

from __future__ import annotations

import warnings

import torch

from mm_adaptor.ops.library import OpSpec, ensure, npu_op_arguments, op, register


def _segments(tokens_per_expert, tokens):
    counts = [int(c) for c in tokens_per_expert.tolist()]
    if sum(counts) != tokens:
        raise RuntimeError(f"grouped_matmul: tokens_per_expert sums to {sum(counts)} but x has {tokens} rows")
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return list(zip(starts[:-1], counts))


def reference_fwd(x, weights, tokens_per_expert):
    y = x.new_empty((x.shape[0], weights.shape[2]))
    for e, (start, count) in enumerate(_segments(tokens_per_expert, x.shape[0])):
        y[start:start + count] = x[start:start + count] @ weights[e]
    return y


def reference_bwd(dy, x, weights, tokens_per_expert):
    dx, dw = torch.empty_like(x), torch.zeros_like(weights)
    for e, (start, count) in enumerate(_segments(tokens_per_expert, x.shape[0])):
        dx[start:start + count] = dy[start:start + count] @ weights[e].t()
        dw[e] = x[start:start + count].t() @ dy[start:start + count]
    return dx, dw


def fake_fwd(x, weights, tokens_per_expert):
    return x.new_empty((x.shape[0], weights.shape[2]))


def fake_bwd(dy, x, weights, tokens_per_expert):
    return torch.empty_like(x), torch.empty_like(weights)


NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INNER_LIMIT = 65536  # torch_npu: the last dim of every x and weight operand stays below it
MAX_GROUPS = 1024  # torch_npu: group_list entries with one 3-D weight
_K_SPLIT: dict[str, bool] = {}  # whether this torch_npu took group_type=2 (op-plugin 7.1.0 refuses it)
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"grouped_matmul on NPU: {message}", RuntimeWarning, stacklevel=3)


def npu_serves(x, weights) -> bool:
    """npu_grouped_matmul with a tensor group_list (op-plugin 7.0.0 on; before it, group_list is a host list that
    takes neither zero-token experts nor one expert): float16/bfloat16/float32, at most 1024 groups, K and N below
    the inner limit."""
    if "group_list_type" not in npu_op_arguments("npu_grouped_matmul"):
        _warn_once("this torch_npu's npu_grouped_matmul has no tensor group_list (op-plugin before 7.0.0): the "
                   "reference runs")
        return False
    experts, k, n = weights.shape
    return (x.dtype in NPU_DTYPES and weights.dtype == x.dtype and experts <= MAX_GROUPS and k < INNER_LIMIT
            and n < INNER_LIMIT)


def check_counts(counts, experts, rows):
    """The native kernels' checks, made in Python before the call where the counts are on the host (a C++ error
    raised inside the native library is the last line of defence, not the first)."""
    if counts.numel() != experts:
        raise RuntimeError(f"grouped_matmul: tokens_per_expert has {counts.numel()} entries for {experts} experts")
    if counts.device.type == "cpu":  # counts on the device are not read back
        if bool((counts < 0).any()):
            raise RuntimeError(f"grouped_matmul: negative token count {int(counts.min())}")
        if int(counts.sum()) != rows:
            raise RuntimeError(f"grouped_matmul: tokens_per_expert sums to {int(counts.sum())} but x has {rows} rows")


def _group_list(counts, x, experts):
    """torch_npu's group_list_type=0 form: the int64 cumulative counts on x's device. Host counts are checked and
    copied; counts already on the device stay there (no host sync)."""
    check_counts(counts, experts, x.shape[0])
    return torch.cumsum(counts.to(torch.int64), 0).to(x.device, non_blocking=True)


def _operand(w):
    """A weight as npu_grouped_matmul takes it: contiguous, or with its last two dims transposed."""
    return w if w.is_contiguous() or w.transpose(-1, -2).is_contiguous() else w.contiguous()


def npu_fwd(x, weights, tokens_per_expert):
    """One npu_grouped_matmul over m-axis groups (group_type=0) with the cumulative int64 group_list
    (group_list_type=0: non-negative, non-decreasing, so zero-token experts are legal; the count form,
    group_list_type=1, refuses a length-1 list). One local expert (EP with one expert per rank) is a plain matmul."""
    experts = weights.shape[0]
    if experts == 1:
        check_counts(tokens_per_expert, 1, x.shape[0])
        return x @ weights[0]
    if x.shape[0] == 0 or not npu_serves(x, weights):
        return reference_fwd(x, weights, tokens_per_expert)
    import torch_npu

    group_list = _group_list(tokens_per_expert, x, experts)
    return torch_npu.npu_grouped_matmul([x.contiguous()], [_operand(weights)], group_list=group_list, group_type=0,
                                        group_list_type=0, split_item=3)[0]


def _weight_grad(x, dy, group_list, tokens_per_expert):
    """dw[e] = x_e^T @ dy_e: one npu_grouped_matmul over k-axis groups (group_type=2, x as [K, M]: its transpose),
    op-plugin 7.2.0 on; 7.0.0 (its schema has no tuning_config) does not check group_type and 7.1.0 refuses 2, so
    there, and after a refusal, one matmul per expert (host counts: a sync if they are on the device)."""
    import torch_npu

    if "tuning_config" in npu_op_arguments("npu_grouped_matmul") and _K_SPLIT.get("ok", True):
        try:
            dw = torch_npu.npu_grouped_matmul([x.contiguous().t()], [dy], group_list=group_list, group_type=2,
                                              group_list_type=0, split_item=3)[0]
        except RuntimeError as exc:
            if _K_SPLIT.get("ok") or "group_type" not in str(exc):
                raise
            _K_SPLIT["ok"] = False
        else:
            _K_SPLIT["ok"] = True
            # torch_npu documents no value for an empty k group: zero-token experts get zeros here
            empty = torch.diff(group_list, prepend=group_list.new_zeros(1)) == 0
            return torch.where(empty.view(-1, 1, 1), torch.zeros((), dtype=dw.dtype, device=dw.device), dw)
    _warn_once("this torch_npu's npu_grouped_matmul has no k-axis groups (group_type=2, op-plugin 7.2.0 on): the "
               "weight gradients run one matmul per expert")
    return torch.stack([x[start:start + count].t() @ dy[start:start + count]
                        for start, count in _segments(tokens_per_expert, x.shape[0])])


def npu_bwd(dy, x, weights, tokens_per_expert):
    """dx by npu_grouped_matmul of dy with the transposed weights (group_type=0), dw by k-axis groups
    (_weight_grad); no host sync when the counts are on the device."""
    experts = weights.shape[0]
    if experts == 1:
        check_counts(tokens_per_expert, 1, x.shape[0])
        return dy @ weights[0].t(), (x.t() @ dy).unsqueeze(0)
    if x.shape[0] == 0 or not npu_serves(x, weights):
        return reference_bwd(dy, x, weights, tokens_per_expert)
    import torch_npu

    group_list = _group_list(tokens_per_expert, x, experts)
    dx = torch_npu.npu_grouped_matmul([dy.contiguous()], [_operand(weights.transpose(1, 2))], group_list=group_list,
                                      group_type=0, group_list_type=0, split_item=3)[0]
    return dx, _weight_grad(x, dy.contiguous(), group_list, tokens_per_expert)


def setup_context(ctx, inputs, output):
    x, weights, counts = inputs
    ctx.save_for_backward(x, weights, counts)


def backward(ctx, dy):
    x, weights, counts = ctx.saved_tensors
    dx, dw = op("grouped_matmul_bwd")(dy.contiguous(), x, weights, counts)
    return dx, dw, None


SPECS = register(
    OpSpec("grouped_matmul_fwd", "(Tensor x, Tensor weights, Tensor tokens_per_expert) -> Tensor", reference_fwd,
           fake_fwd, native=("cpu", "cuda"), npu=npu_fwd, backward=backward, setup_context=setup_context),
    OpSpec("grouped_matmul_bwd", "(Tensor dy, Tensor x, Tensor weights, Tensor tokens_per_expert) -> (Tensor, Tensor)",
           reference_bwd, fake_bwd, native=("cpu", "cuda"), npu=npu_bwd),
)


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Expert GEMMs over token-sorted rows: y[rows of e] = x[rows of e] @ weights[e] (counts: placed_counts)."""
    ensure(x.device.type)
    counts = placed_counts(x, tokens_per_expert)
    check_counts(counts, weights.shape[0], x.shape[0])
    return op("grouped_matmul_fwd")(x, weights, counts)


def placed_counts(x: torch.Tensor, tokens_per_expert) -> torch.Tensor:
    """The int64 counts where the op reads them: on the host, except on the NPU when they are already on x's device
    (torch_npu reads them there: no host sync)."""
    if not torch.is_tensor(tokens_per_expert):
        tokens_per_expert = torch.tensor(list(tokens_per_expert), dtype=torch.long)
    if x.device.type == "npu" and tokens_per_expert.device == x.device:
        return tokens_per_expert.long()
    return tokens_per_expert.to("cpu", torch.long)
