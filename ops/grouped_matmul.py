"""grouped_matmul: MoE expert GEMMs over token-sorted rows, y[rows of e] = x[rows of e] @ weights[e].
Native kernels: csrc/common/grouped_matmul.cpp (ATen GEMMs, in every device's library); NPU: npu_grouped_matmul."""

from __future__ import annotations

import torch

from mm_adaptor.ops.library import OpSpec, ensure, op, register


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


def npu_fwd(x, weights, tokens_per_expert):
    """torch_npu documents one 3-D weight only with a tensor group_list and group_type=0; MindSpeed's convention,
    an int64 tensor of counts (group_list_type=1), takes zero-token experts and a single local expert, which a
    Python list (strictly increasing, length != 1) would refuse."""
    import torch_npu

    counts = tokens_per_expert.to(device=x.device, dtype=torch.int64)
    return torch_npu.npu_grouped_matmul([x], [weights], group_list=counts, group_type=0, group_list_type=1,
                                        split_item=3)[0]


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
           reference_bwd, fake_bwd, native=("cpu", "cuda")),
)


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Expert GEMMs over token-sorted rows: y[rows of e] = x[rows of e] @ weights[e]."""
    ensure(x.device.type)
    if not torch.is_tensor(tokens_per_expert):
        tokens_per_expert = torch.tensor(list(tokens_per_expert), dtype=torch.long)
    return op("grouped_matmul_fwd")(x, weights, tokens_per_expert.to("cpu", torch.long))
