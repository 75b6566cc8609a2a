"""--use-coc's autograd functions: a tensor-parallel linear's matmuls chunk by chunk around the chunks' collectives
(coc_chunks), forward and backward, with megatron's weight gradient (one GEMM over the same rows, into main_grad
under gradient-accumulation fusion).

- AllGatherMatmul, column-parallel under sequence parallelism (all-gather -> matmul): every chunk's all-gather is
  issued at once; chunk c is multiplied as soon as its gather is done, while the later ones are in flight.
  Backward: the input is gathered again the same way (for the weight gradient) while each chunk's input gradient
  is computed and its reduce-scatter issued; the weight-gradient GEMM runs whole, over the re-assembled input,
  while the last reduce-scatters are in flight.
- MatmulReduce, row-parallel (matmul -> reduce-scatter, or -> all-reduce without sequence parallelism): each
  chunk's partial product starts its collective as soon as it is computed. Backward under sequence parallelism
  all-gathers the output gradient by chunks, each chunk's input gradient computed while the next is in flight."""

from __future__ import annotations

import torch

from mm_adaptor.patches.tensor_parallel.coc_chunks import Rows, all_reduce, chunk_bounds, record, wait_all


def _matmul_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w as megatron's torch.matmul folds it: one 2-D GEMM over the rows of x made contiguous (torch.matmul
    on a strided batch would take a batched GEMM, whose rounding differs)."""
    return x.reshape(-1, x.shape[-1]).mm(w).view(*x.shape[:-1], w.shape[-1])


_FSDP_GEMM: list = []


def _fsdp_wgrad_gemm():
    """Transformer Engine's general GEMM where the installed megatron's own backward writes Megatron-FSDP's
    main_grad with it (0.18 and later, when TE is present), else None (0.16: torch.matmul)."""
    if not _FSDP_GEMM:
        import inspect

        from megatron.core.tensor_parallel import layers

        gemm = None
        source = inspect.getsource(layers.LinearWithGradAccumulationAndAsyncCommunication.backward)
        if "te_general_gemm" in source:
            from megatron.core.extensions.transformer_engine import te_general_gemm as gemm
        _FSDP_GEMM.append(gemm)
    return _FSDP_GEMM[0]


def _weight_gradient(ctx, weight, grad_output, total_input):
    """Megatron's weight gradient (LinearWithGradAccumulationAndAsyncCommunication.backward's tail): one GEMM into
    main_grad under gradient-accumulation fusion (with its dummy grad for the DDP hooks), else the plain GEMM."""
    from megatron.core.tensor_parallel import layers

    grad_output, total_input = layers.prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
    if not ctx.gradient_accumulation_fusion:
        return grad_output.t().matmul(total_input)
    main_grad = weight.main_grad
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()
        te_gemm = _fsdp_wgrad_gemm()
        if te_gemm is not None:  # megatron 0.18+: Transformer Engine's GEMM, for a main_grad of another dtype
            te_gemm(total_input, grad_output, out_dtype=weight.main_grad.dtype, layout="NT", out=weight.main_grad,
                    grad=True)
        else:
            torch.matmul(grad_output.t(), total_input, out=weight.main_grad)
    elif main_grad.dtype == torch.float32:
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    else:
        raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    shape, dtype = list(weight.main_grad.shape), ctx.input_dtype
    zero = getattr(weight, "zero_out_wgrad", False)
    if layers.HAVE_TE:
        dummy = layers.get_dummy_wgrad(shape, dtype, zero=True) if zero else layers.get_dummy_wgrad(shape, dtype)
    else:
        dummy = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=weight.device, requires_grad=False)
    weight.grad_added_to_main_grad = True
    return dummy


def _save_common(ctx, input, weight, gradient_accumulation_fusion, chunks, group, counts, trace):
    ctx.save_for_backward(input, weight)
    ctx.counts, ctx.trace = counts, trace
    ctx.main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
    ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
    ctx.chunks, ctx.group, ctx.input_dtype = chunks, group, input.dtype


def _restore_main_grad(ctx, weight):
    if ctx.gradient_accumulation_fusion:
        weight.main_grad = ctx.main_grad


class AllGatherMatmul(torch.autograd.Function):
    """Column-parallel linear under sequence parallelism: all-gather(input) @ weight.T (+ bias), by chunks.
    counts: rows per rank when they differ (MoE experts), else None (every rank holds input.shape[0]).
    trace: a list that receives the (event, chunk) pairs, or None."""

    @staticmethod
    def slot(c: int, chunks: int) -> int:
        """Where chunk c's product goes (the harness's self-test overrides it with a wrong one)."""
        return c

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, chunks, group, counts=None, trace=None):
        _save_common(ctx, input, weight, gradient_accumulation_fusion, chunks, group, counts, trace)
        ctx.use_bias = bias is not None
        rows = Rows.of(counts, input.shape[0], chunks, group, trace)
        gathers = rows.gather_all(input, "input")
        output = None  # not a view: megatron's cross-entropy writes into the logits in place
        for c, gathered in enumerate(gathers):
            product = _matmul_rows(gathered.wait(), weight.t())
            record(trace, "matmul", c)
            if output is None:
                output = product.new_empty((rows.total, *product.shape[1:]))
            rows.place(output, AllGatherMatmul.slot(c, rows.chunks), product)
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        _restore_main_grad(ctx, weight)
        rows = Rows.of(ctx.counts, input.shape[0], ctx.chunks, ctx.group, ctx.trace)
        gathers = rows.gather_all(input, "input")  # for the weight gradient, in flight meanwhile
        grad_input, reductions = None, []
        for c in range(rows.chunks):
            partial = _matmul_rows(rows.pick(grad_output, c), weight)
            record(ctx.trace, "matmul", c)
            if grad_input is None:
                grad_input = partial.new_empty((input.shape[0], *partial.shape[1:]))
            start, length = rows.own(c)
            reductions.append(rows.reduce_scatter(partial, c, grad_input[start:start + length]))
        grad_weight = _weight_gradient(ctx, weight, grad_output, rows.assembled(gathers))
        record(ctx.trace, "weight gradient", rows.chunks - 1)
        # as megatron: summed over the rows of the 2-D gradient its weight-gradient GEMM used
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if ctx.use_bias else None
        wait_all(reductions)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class MatmulReduce(torch.autograd.Function):
    """Row-parallel linear: input @ weight.T, reduce-scattered (sequence parallel) or all-reduced, by chunks.
    counts: rows per rank of the reduce-scatter's result when they differ (MoE experts), else None; trace: as
    AllGatherMatmul's."""

    @staticmethod
    def forward(ctx, input, weight, gradient_accumulation_fusion, sequence_parallel, chunks, group, counts=None,
                reduce_dtype=None, trace=None):
        _save_common(ctx, input, weight, gradient_accumulation_fusion, chunks, group, counts, trace)
        ctx.sequence_parallel = sequence_parallel
        if not sequence_parallel:
            return _matmul_all_reduce(input, weight, chunks, group, trace)
        rows = Rows.of(counts, input.shape[0] // group.size(), chunks, group, trace)
        output, reductions = None, []
        for c in range(rows.chunks):
            partial = _matmul_rows(rows.pick(input, c), weight.t())
            record(trace, "matmul", c)
            if reduce_dtype is not None:  # megatron's expert combine reduces in the routing probabilities' dtype
                partial = partial.to(reduce_dtype)
            if output is None:
                output = partial.new_empty((rows.counts[rows.rank], *partial.shape[1:]))
            start, length = rows.own(c)
            reductions.append(rows.reduce_scatter(partial, c, output[start:start + length]))
        wait_all(reductions)
        return output.to(input.dtype) if reduce_dtype is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        _restore_main_grad(ctx, weight)
        if not ctx.sequence_parallel:  # the all-reduce's gradient is the identity: no collective to overlap
            total_grad = grad_output
            grad_input = grad_output.matmul(weight)
        else:
            rows = Rows.of(ctx.counts, grad_output.shape[0], ctx.chunks, ctx.group, ctx.trace)
            grad_input = total_grad = None
            for c, gathered in enumerate(rows.gather_all(grad_output, "output gradient")):
                chunk = gathered.wait()
                partial = _matmul_rows(chunk, weight)
                record(ctx.trace, "matmul", c)
                if grad_input is None:
                    grad_input = partial.new_empty((rows.total, *partial.shape[1:]))
                    total_grad = chunk.new_empty((rows.total, *chunk.shape[1:]))
                rows.place(grad_input, c, partial)
                rows.place(total_grad, c, chunk)
        grad_weight = _weight_gradient(ctx, weight, total_grad, input)
        return grad_input, grad_weight, None, None, None, None, None, None, None


def _matmul_all_reduce(input, weight, chunks, group, trace):
    """Without sequence parallelism: each chunk of rows all-reduced as soon as it is computed."""
    output, works = None, []
    for c, (start, length) in enumerate(chunk_bounds(input.shape[0], chunks)):
        partial = _matmul_rows(input[start:start + length], weight.t())
        record(trace, "matmul", c)
        if output is None:
            output = partial.new_empty((input.shape[0], *partial.shape[1:]))
        output[start:start + length] = partial
        works.append(all_reduce(output[start:start + length], c, group, trace))
    wait_all(works)
    return output
