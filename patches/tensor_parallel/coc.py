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

import contextlib
from collections import Counter
from dataclasses import dataclass

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
    return _split(rows, max(1, min(chunks, rows)))


def _split(rows: int, chunks: int) -> list[tuple[int, int]]:
    """(start, length) of exactly `chunks` ranges covering `rows` (empty ones when rows < chunks)."""
    base, longer = divmod(rows, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        length = base + (c < longer)
        bounds.append((start, length))
        start += length
    return bounds


class Rows:
    """The rows of a gathered tensor, rank-major as megatron gathers them (rank r's counts[r] rows, uneven for
    MoE experts), and their chunks: chunk c holds the c-th range of every rank's rows."""

    def __init__(self, counts, chunks: int, group):
        self.counts, self.tp, self.rank = list(counts), group.size(), group.rank()
        self.group = group
        self.offsets = [sum(self.counts[:r]) for r in range(len(self.counts))]
        self.total = sum(self.counts)
        self.chunks = max(1, min(chunks, max(self.counts)))
        self.bounds = [_split(count, self.chunks) for count in self.counts]

    @classmethod
    def even(cls, rows_per_rank: int, chunks: int, group) -> "Rows":
        return cls([rows_per_rank] * group.size(), chunks, group)

    def lengths(self, c: int) -> list[int]:
        return [bounds[c][1] for bounds in self.bounds]

    def own(self, c: int) -> tuple[int, int]:
        """(start, length) of chunk c in this rank's own rows."""
        return self.bounds[self.rank][c]

    def ranges(self, c: int) -> list[tuple[int, int]]:
        """(start, length) of chunk c in the whole tensor, per rank."""
        return [(self.offsets[r] + self.bounds[r][c][0], self.bounds[r][c][1]) for r in range(self.tp)]

    def pick(self, whole: torch.Tensor, c: int) -> torch.Tensor:
        """Chunk c's rows of a whole tensor, contiguous, rank-major."""
        return torch.cat([whole[s:s + n] for s, n in self.ranges(c)])

    def place(self, whole: torch.Tensor, c: int, rows: torch.Tensor) -> None:
        at = 0
        for s, n in self.ranges(c):
            whole[s:s + n] = rows[at:at + n]
            at += n

    def gather(self, local: torch.Tensor, c: int, what: str) -> "_Pending":
        """All-gather this rank's chunk c (async): its wait() gives chunk c's rows of every rank, rank-major."""
        start, length = self.own(c)
        lengths = self.lengths(c)
        widest = max(lengths)
        part = local[start:start + length]
        if widest == 0:  # every rank's chunk is empty (an expert without tokens)
            return _Pending(_DONE, lambda: part, f"wait all-gather {what}", c)
        if length < widest:  # all-gather takes equal sizes: pad, and drop the padding after
            part = torch.cat([part, part.new_zeros((widest - length, *part.shape[1:]))])
        buffer = local.new_empty((self.tp * widest, *local.shape[1:]))
        work = ALL_GATHER(buffer, part.contiguous(), group=self.group, async_op=True)
        _trace(f"issue all-gather {what}", c)

        def result():
            if min(lengths) == widest:
                return buffer
            return torch.cat([buffer[r * widest:r * widest + n] for r, n in enumerate(lengths)])

        return _Pending(work, result, f"wait all-gather {what}", c)

    def reduce_scatter(self, rows: torch.Tensor, c: int, out: torch.Tensor) -> "_Pending":
        """Reduce-scatter chunk c's rows of every rank (rank-major) into `out`, this rank's chunk c (async)."""
        lengths, (_start, length) = self.lengths(c), self.own(c)
        widest = max(lengths)
        if widest == 0:
            return _Pending(_DONE, lambda: rows, "wait reduce", c)
        if min(lengths) == widest:
            work = REDUCE_SCATTER(out, rows, group=self.group, async_op=True)
            _trace("issue reduce-scatter", c)
            return _Pending(work, lambda: rows, "wait reduce", c)  # keeps `rows` alive until done
        padded = rows.new_zeros((self.tp * widest, *rows.shape[1:]))
        at = 0
        for r, n in enumerate(lengths):
            padded[r * widest:r * widest + n] = rows[at:at + n]
            at += n
        mine = rows.new_empty((widest, *rows.shape[1:]))
        work = REDUCE_SCATTER(mine, padded, group=self.group, async_op=True)
        _trace("issue reduce-scatter", c)
        return _Pending(work, lambda: out.copy_(mine[:length]), "wait reduce", c)


class _Done:
    @staticmethod
    def wait():
        return True


_DONE = _Done()


class _Pending:
    def __init__(self, work, result, event: str, chunk: int):
        self.work, self._result, self.event, self.chunk = work, result, event, chunk

    def wait(self):
        self.work.wait()
        _trace(self.event, self.chunk)
        return self._result()


def _gather_all(rows: Rows, local: torch.Tensor, what: str) -> list[_Pending]:
    """Every chunk's all-gather, issued at once."""
    return [rows.gather(local, c, what) for c in range(rows.chunks)]


def _assembled(rows: Rows, pending: list[_Pending]) -> torch.Tensor:
    """The whole gathered tensor in megatron's row order, each chunk awaited."""
    whole = None
    for c, gathered in enumerate(pending):
        chunk = gathered.wait()
        if whole is None:
            whole = chunk.new_empty((rows.total, *chunk.shape[1:]))
        rows.place(whole, c, chunk)
    return whole


def _wait_all(pending) -> None:
    for item in pending:
        item.wait()


def _matmul_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w as megatron's torch.matmul folds it: one 2-D GEMM over the rows of x made contiguous (torch.matmul
    on a strided batch would take a batched GEMM, whose rounding differs)."""
    return x.reshape(-1, x.shape[-1]).mm(w).view(*x.shape[:-1], w.shape[-1])


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
    """Column-parallel linear under sequence parallelism: all-gather(input) @ weight.T (+ bias), by chunks.
    counts: rows per rank when they differ (MoE experts), else None (every rank holds input.shape[0])."""

    @staticmethod
    def slot(c: int, chunks: int) -> int:
        """Where chunk c's product goes (the harness's self-test overrides it with a wrong one)."""
        return c

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, chunks, group, counts=None):
        _save_common(ctx, input, weight, gradient_accumulation_fusion, chunks, group)
        ctx.use_bias, ctx.counts = bias is not None, counts
        CALLS["expert fc1 all-gather" if counts else "column-parallel all-gather"] += 1
        rows = Rows(counts, chunks, group) if counts else Rows.even(input.shape[0], chunks, group)
        gathers = _gather_all(rows, input, "input")
        output = None  # not a view: megatron's cross-entropy writes into the logits in place
        for c, gathered in enumerate(gathers):
            product = _matmul_rows(gathered.wait(), weight.t())
            _trace("matmul", c)
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
        rows = Rows(ctx.counts, ctx.chunks, ctx.group) if ctx.counts else \
            Rows.even(input.shape[0], ctx.chunks, ctx.group)
        gathers = _gather_all(rows, input, "input")  # for the weight gradient, in flight meanwhile
        grad_input, reductions = None, []
        for c in range(rows.chunks):
            partial = _matmul_rows(rows.pick(grad_output, c), weight)
            _trace("matmul", c)
            if grad_input is None:
                grad_input = partial.new_empty((input.shape[0], *partial.shape[1:]))
            start, length = rows.own(c)
            reductions.append(rows.reduce_scatter(partial, c, grad_input[start:start + length]))
        grad_weight = _weight_gradient(ctx, weight, grad_output, _assembled(rows, gathers))
        _trace("weight gradient", rows.chunks - 1)
        # as megatron: summed over the rows of the 2-D gradient its weight-gradient GEMM used
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if ctx.use_bias else None
        _wait_all(reductions)
        return grad_input, grad_weight, grad_bias, None, None, None, None


class MatmulReduce(torch.autograd.Function):
    """Row-parallel linear: input @ weight.T, reduce-scattered (sequence parallel) or all-reduced, by chunks.
    counts: rows per rank of the reduce-scatter's result when they differ (MoE experts), else None."""

    @staticmethod
    def forward(ctx, input, weight, gradient_accumulation_fusion, sequence_parallel, chunks, group, counts=None,
                reduce_dtype=None):
        _save_common(ctx, input, weight, gradient_accumulation_fusion, chunks, group)
        ctx.sequence_parallel, ctx.counts = sequence_parallel, counts
        CALLS["expert fc2 reduce-scatter" if counts else
              "row-parallel reduce-scatter" if sequence_parallel else "row-parallel all-reduce"] += 1
        if not sequence_parallel:
            return _matmul_all_reduce(input, weight, chunks, group)
        rows = Rows(counts, chunks, group) if counts else Rows.even(input.shape[0] // group.size(), chunks, group)
        output, reductions = None, []
        for c in range(rows.chunks):
            partial = _matmul_rows(rows.pick(input, c), weight.t())
            _trace("matmul", c)
            if reduce_dtype is not None:  # megatron's expert combine reduces in the routing probabilities' dtype
                partial = partial.to(reduce_dtype)
            if output is None:
                output = partial.new_empty((rows.counts[rows.rank], *partial.shape[1:]))
            start, length = rows.own(c)
            reductions.append(rows.reduce_scatter(partial, c, output[start:start + length]))
        _wait_all(reductions)
        return output.to(input.dtype) if reduce_dtype is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        _restore_main_grad(ctx, weight)
        if not ctx.sequence_parallel:  # the all-reduce's gradient is the identity: no collective to overlap
            total_grad = grad_output
            grad_input = grad_output.matmul(weight)
        else:
            rows = Rows(ctx.counts, ctx.chunks, ctx.group) if ctx.counts else \
                Rows.even(grad_output.shape[0], ctx.chunks, ctx.group)
            grad_input = total_grad = None
            for c, gathered in enumerate(_gather_all(rows, grad_output, "output gradient")):
                chunk = gathered.wait()
                partial = _matmul_rows(chunk, weight)
                _trace("matmul", c)
                if grad_input is None:
                    grad_input = partial.new_empty((rows.total, *partial.shape[1:]))
                    total_grad = chunk.new_empty((rows.total, *chunk.shape[1:]))
                rows.place(grad_input, c, partial)
                rows.place(total_grad, c, chunk)
        grad_weight = _weight_gradient(ctx, weight, total_grad, input)
        return grad_input, grad_weight, None, None, None, None, None, None


def _matmul_all_reduce(input, weight, chunks, group):
    """Without sequence parallelism: each chunk of rows all-reduced as soon as it is computed."""
    output, works = None, []
    for c, (start, length) in enumerate(chunk_bounds(input.shape[0], chunks)):
        partial = _matmul_rows(input[start:start + length], weight.t())
        _trace("matmul", c)
        if output is None:
            output = partial.new_empty((input.shape[0], *partial.shape[1:]))
        output[start:start + length] = partial
        works.append(_Pending(dist.all_reduce(output[start:start + length], group=group, async_op=True),
                              lambda: None, "wait reduce", c))
        _trace("issue all-reduce", c)
    _wait_all(works)
    return output


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


@dataclass(frozen=True)
class ExpertRows:
    """While an expert runs under chunked expert-TP collectives: its rows per expert-TP rank, and the dtype
    megatron's combine reduces in."""

    counts: tuple
    reduce_dtype: torch.dtype


_EXPERT: ExpertRows | None = None


@contextlib.contextmanager
def expert_collectives(counts, reduce_dtype):
    """Within: an expert's fc1 gathers its rows from the expert-TP ranks and its fc2 reduce-scatters them back."""
    global _EXPERT
    saved, _EXPERT = _EXPERT, ExpertRows(tuple(counts), reduce_dtype)
    try:
        yield
    finally:
        _EXPERT = saved


def column_parallel_expert_forward_chunked(chunks: int):
    """Wrapper of ColumnParallelLinear.forward: an expert's fc1 inside expert_collectives gathers its rows."""

    def wrapper(wrapped, instance, args, kwargs):
        if _EXPERT is None or not instance.explicit_expert_comm:
            return wrapped(*args, **kwargs)
        input_ = args[0] if args else kwargs["input_"]
        bias = instance.bias if not instance.skip_bias_add else None
        output = AllGatherMatmul.apply(input_, instance.weight, bias, instance.gradient_accumulation_fusion, chunks,
                                       instance.tp_group, _EXPERT.counts)
        return output, (instance.bias if instance.skip_bias_add else None)

    return wrapper


def row_parallel_forward_chunked(chunks: int):
    """Wrapper of RowParallelLinear.forward: its matmul and reduce-scatter (or all-reduce) go by chunks where
    megatron would run them itself (input already split, a trainable weight, no expert or offloading path)."""

    def wrapper(wrapped, instance, args, kwargs):
        input_ = args[0] if args else kwargs["input_"]
        group = instance.tp_group
        if _EXPERT is not None and instance.explicit_expert_comm:  # an expert's fc2: reduce-scatter its rows back
            output_ = MatmulReduce.apply(input_, instance.weight, instance.gradient_accumulation_fusion, True, chunks,
                                         group, _EXPERT.counts, _EXPERT.reduce_dtype)
            return output_, instance.bias
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
