"""--use-coc: tensor-parallel linears whose collective runs chunk by chunk while other chunks are multiplied.

Chunks are ranges of each rank's sequence rows (uneven when the rows do not divide). A chunk of the gathered
sequence holds the same row range of every rank, so each collective is Megatron's own on a smaller tensor and
every output row lands where Megatron puts it:

- column-parallel under sequence parallelism (all-gather -> matmul): every chunk's all-gather is issued at once;
  chunk c is multiplied as soon as its gather is done, while the later ones are in flight. Backward: the input
  is gathered again the same way (for the weight gradient) while each chunk's input gradient is computed and its
  reduce-scatter issued; the weight-gradient GEMM runs whole, over the re-assembled input, while the last
  reduce-scatters are in flight.
- row-parallel (matmul -> reduce-scatter, or -> all-reduce without sequence parallelism): each chunk's partial
  product starts its collective as soon as it is computed. Backward under sequence parallelism all-gathers the
  output gradient by chunks, each chunk's input gradient computed while the next is in flight.

Every GEMM row sees the same operands as Megatron's, and the weight gradient is one GEMM over the same rows in the
same order, so the only arithmetic that could differ is a reduction over ranks: a sum of two values (TP2) is the
same in any order."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-to-tensor collectives (the old names warn)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# forward calls that went by chunks, per kind of linear (the feature's statistics)
CALLS: Counter = Counter()

# (event, chunk) pairs in the order they happen, while a test sets this to a list.
TRACE: list | None = None


def _trace(event: str, chunk: int) -> None:
    if TRACE is not None:
        TRACE.append((event, chunk))


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """(start, length) of up to `chunks` ranges covering `rows`, the first rows % chunks one row longer."""
    chunks = max(1, min(chunks, rows))
    base, longer = divmod(rows, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        length = base + (c < longer)
        bounds.append((start, length))
        start += length
    return bounds


class _Gathers:
    """All-gathers of every chunk of `local` (issued at once); `wait(c)` gives chunk c as [tp, length, ...]."""

    def __init__(self, local: torch.Tensor, bounds, group, what: str):
        self.tp, self.bounds, self.what = group.size(), bounds, what
        self.pending = []
        for c, (start, length) in enumerate(bounds):
            buffer = local.new_empty((self.tp * length, *local.shape[1:]))
            work = ALL_GATHER(buffer, local[start:start + length].contiguous(), group=group,
                                               async_op=True)
            _trace(f"issue all-gather {what}", c)
            self.pending.append((buffer, work))

    def wait(self, c: int) -> torch.Tensor:
        buffer, work = self.pending[c]
        work.wait()
        _trace(f"wait all-gather {self.what}", c)
        return buffer.view(self.tp, self.bounds[c][1], *buffer.shape[1:])

    def assembled(self, rows: int) -> torch.Tensor:
        """The whole gathered tensor in Megatron's row order (rank-major), each chunk awaited."""
        first = self.wait(0)
        whole = first.new_empty((self.tp, rows, *first.shape[2:]))
        for c, (start, length) in enumerate(self.bounds):
            whole[:, start:start + length] = first if c == 0 else self.wait(c)
        return whole.view(self.tp * rows, *whole.shape[2:])


def _wait_all(works) -> None:
    for c, work in enumerate(works):
        work.wait()
        _trace("wait reduce", c)


def _matmul_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w as megatron's torch.matmul folds it: one 2-D GEMM over the rows of x made contiguous (torch.matmul
    on a strided batch would take a batched GEMM, whose rounding differs)."""
    return x.reshape(-1, x.shape[-1]).mm(w).view(*x.shape[:-1], w.shape[-1])


def _ranks_view(t: torch.Tensor, tp: int) -> torch.Tensor:
    return t.view(tp, t.shape[0] // tp, *t.shape[1:])


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


def _save_common(ctx, input, weight, gradient_accumulation_fusion, chunks, group):
    ctx.save_for_backward(input, weight)
    ctx.main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
    ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
    ctx.chunks, ctx.group, ctx.input_dtype = chunks, group, input.dtype


def _restore_main_grad(ctx, weight):
    if ctx.gradient_accumulation_fusion:
        weight.main_grad = ctx.main_grad


class AllGatherMatmul(torch.autograd.Function):
    """Column-parallel linear under sequence parallelism: all-gather(input) @ weight.T (+ bias), by chunks."""

    @staticmethod
    def slot(c: int, chunks: int) -> int:
        """Where chunk c's product goes (the harness's self-test overrides it with a wrong one)."""
        return c

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, chunks, group):
        _save_common(ctx, input, weight, gradient_accumulation_fusion, chunks, group)
        ctx.use_bias = bias is not None
        CALLS["column-parallel all-gather"] += 1
        rows = input.shape[0]
        bounds = chunk_bounds(rows, chunks)
        gathers = _Gathers(input, bounds, group, "input")
        output = None  # not a view: megatron's cross-entropy writes into the logits in place
        for c, (start, length) in enumerate(bounds):
            product = _matmul_rows(gathers.wait(c), weight.t())
            _trace("matmul", c)
            if output is None:
                output = product.new_empty((group.size() * rows, *product.shape[2:]))
            start = bounds[AllGatherMatmul.slot(c, len(bounds))][0]
            _ranks_view(output, group.size())[:, start:start + length] = product
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        _restore_main_grad(ctx, weight)
        tp, rows = ctx.group.size(), input.shape[0]
        bounds = chunk_bounds(rows, ctx.chunks)
        gathers = _Gathers(input, bounds, ctx.group, "input")  # for the weight gradient, in flight meanwhile
        per_rank = _ranks_view(grad_output, tp)
        grad_input, reductions, partials = None, [], []
        for c, (start, length) in enumerate(bounds):
            partial = _matmul_rows(per_rank[:, start:start + length], weight)
            _trace("matmul", c)
            if grad_input is None:
                grad_input = partial.new_empty((rows, *partial.shape[2:]))
            reductions.append(REDUCE_SCATTER(grad_input[start:start + length],
                                                         partial.view(tp * length, *partial.shape[2:]),
                                                         group=ctx.group, async_op=True))
            _trace("issue reduce-scatter", c)
            partials.append(partial)  # alive until its reduce-scatter is done
        grad_weight = _weight_gradient(ctx, weight, grad_output, gathers.assembled(rows))
        _trace("weight gradient", len(bounds) - 1)
        # as megatron: summed over the rows of the 2-D gradient its weight-gradient GEMM used
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if ctx.use_bias else None
        _wait_all(reductions)
        return grad_input, grad_weight, grad_bias, None, None, None


class MatmulReduce(torch.autograd.Function):
    """Row-parallel linear: input @ weight.T, reduce-scattered (sequence parallel) or all-reduced, by chunks."""

    @staticmethod
    def forward(ctx, input, weight, gradient_accumulation_fusion, sequence_parallel, chunks, group):
        _save_common(ctx, input, weight, gradient_accumulation_fusion, chunks, group)
        ctx.sequence_parallel = sequence_parallel
        CALLS["row-parallel reduce-scatter" if sequence_parallel else "row-parallel all-reduce"] += 1
        tp = group.size()
        if sequence_parallel:
            per_rank = _ranks_view(input, tp)
            rows = per_rank.shape[1]
        else:
            rows = input.shape[0]
        output, works, partials = None, [], []
        for c, (start, length) in enumerate(chunk_bounds(rows, chunks)):
            if sequence_parallel:
                partial = _matmul_rows(per_rank[:, start:start + length], weight.t())
                _trace("matmul", c)
                if output is None:
                    output = partial.new_empty((rows, *partial.shape[2:]))
                works.append(REDUCE_SCATTER(output[start:start + length],
                                                        partial.view(tp * length, *partial.shape[2:]),
                                                        group=group, async_op=True))
                partials.append(partial)
                _trace("issue reduce-scatter", c)
            else:
                partial = _matmul_rows(input[start:start + length], weight.t())
                _trace("matmul", c)
                if output is None:
                    output = partial.new_empty((rows, *partial.shape[1:]))
                output[start:start + length] = partial
                works.append(dist.all_reduce(output[start:start + length], group=group, async_op=True))
                _trace("issue all-reduce", c)
        _wait_all(works)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        _restore_main_grad(ctx, weight)
        if not ctx.sequence_parallel:  # the all-reduce's gradient is the identity: no collective to overlap
            total_grad = grad_output
            grad_input = grad_output.matmul(weight)
        else:
            tp, rows = ctx.group.size(), grad_output.shape[0]
            bounds = chunk_bounds(rows, ctx.chunks)
            gathers = _Gathers(grad_output, bounds, ctx.group, "output gradient")
            grad_input = None
            whole = None
            for c, (start, length) in enumerate(bounds):
                chunk = gathers.wait(c)
                partial = _matmul_rows(chunk, weight)
                _trace("matmul", c)
                if grad_input is None:
                    grad_input = partial.new_empty((tp, rows, *partial.shape[2:]))
                    whole = chunk.new_empty((tp, rows, *chunk.shape[2:]))
                grad_input[:, start:start + length] = partial
                whole[:, start:start + length] = chunk
            grad_input = grad_input.view(tp * rows, *grad_input.shape[2:])
            total_grad = whole.view(tp * rows, *whole.shape[2:])
        grad_weight = _weight_gradient(ctx, weight, total_grad, input)
        return grad_input, grad_weight, None, None, None, None


def _group_or_default(tp_group):
    from megatron.core.parallel_state import get_tensor_model_parallel_group

    return tp_group if tp_group is not None else get_tensor_model_parallel_group()


def linear_chunked_under_sequence_parallel(chunks: int):
    """Wrapper of megatron's linear_with_grad_accumulation_and_async_allreduce: its sequence-parallel all-gather
    (column-parallel linears) goes by chunks; every other use runs megatron's."""

    def wrapper(wrapped, instance, args, kwargs):
        bound = _bind(args, kwargs)
        group = None
        if bound.get("sequence_parallel") and not bound.get("grad_output_buffer") and chunks > 1:
            group = _group_or_default(bound.get("tp_group"))
        if group is None or group.size() == 1:
            return wrapped(*args, **kwargs)
        return AllGatherMatmul.apply(bound["input"], bound["weight"], bound["bias"],
                                     bound["gradient_accumulation_fusion"], chunks, group)

    return wrapper


_LINEAR_PARAMS = ("input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
                  "grad_output_buffer", "wgrad_deferral_limit", "async_grad_allreduce", "tp_group")


def _bind(args, kwargs) -> dict:
    bound = dict(zip(_LINEAR_PARAMS, args))
    bound.update(kwargs)
    return bound


def row_parallel_forward_chunked(chunks: int):
    """Wrapper of RowParallelLinear.forward: its matmul and reduce-scatter (or all-reduce) go by chunks where
    megatron would run them itself (input already split, a trainable weight, no expert or offloading path)."""

    def wrapper(wrapped, instance, args, kwargs):
        input_ = args[0] if args else kwargs["input_"]
        group = instance.tp_group
        if (chunks == 1 or group is None or group.size() == 1 or not instance.input_is_parallel
                or instance.explicit_expert_comm or instance.config._cpu_offloading_context is not None
                or not instance.weight.requires_grad):
            return wrapped(*args, **kwargs)
        output_ = MatmulReduce.apply(input_, instance.weight, instance.gradient_accumulation_fusion,
                                     instance.sequence_parallel, chunks, group)
        if not instance.skip_bias_add:
            output = (output_ + instance.bias) if instance.bias is not None else output_
            return output, None
        return output_, instance.bias

    return wrapper
