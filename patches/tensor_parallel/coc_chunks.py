"""--use-coc's chunk plan and collectives: which rows form chunk c of every rank, and each chunk's asynchronous
all-gather or reduce-scatter (padded when the ranks' chunks differ in length, as MoE experts' rows do).

A trace, when a list is given, receives (event, chunk) pairs in the order they happen (the tests read it to see
that matmuls overlap the collectives)."""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-to-tensor collectives (the old names warn)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def record(trace: list | None, event: str, chunk: int) -> None:
    if trace is not None:
        trace.append((event, chunk))


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

    def __init__(self, counts, chunks: int, group, trace: list | None = None):
        self.counts, self.tp, self.rank = list(counts), group.size(), group.rank()
        self.group, self.trace = group, trace
        self.offsets = [sum(self.counts[:r]) for r in range(len(self.counts))]
        self.total = sum(self.counts)
        self.chunks = max(1, min(chunks, max(self.counts)))
        self.bounds = [_split(count, self.chunks) for count in self.counts]

    @classmethod
    def of(cls, counts, rows_per_rank: int, chunks: int, group, trace: list | None = None) -> "Rows":
        """`counts` rows per rank when they differ (MoE experts), else rows_per_rank on every rank."""
        return cls(counts or [rows_per_rank] * group.size(), chunks, group, trace)

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

    def gather(self, local: torch.Tensor, c: int, what: str) -> "Pending":
        """All-gather this rank's chunk c (async): its wait() gives chunk c's rows of every rank, rank-major."""
        start, length = self.own(c)
        lengths = self.lengths(c)
        widest = max(lengths)
        part = local[start:start + length]
        if widest == 0:  # every rank's chunk is empty (an expert without tokens)
            return Pending(_DONE, lambda: part, f"wait all-gather {what}", c, self.trace)
        if length < widest:  # all-gather takes equal sizes: pad, and drop the padding after
            part = torch.cat([part, part.new_zeros((widest - length, *part.shape[1:]))])
        buffer = local.new_empty((self.tp * widest, *local.shape[1:]))
        work = ALL_GATHER(buffer, part.contiguous(), group=self.group, async_op=True)
        record(self.trace, f"issue all-gather {what}", c)

        def result():
            if min(lengths) == widest:
                return buffer
            return torch.cat([buffer[r * widest:r * widest + n] for r, n in enumerate(lengths)])

        return Pending(work, result, f"wait all-gather {what}", c, self.trace)

    def reduce_scatter(self, rows: torch.Tensor, c: int, out: torch.Tensor) -> "Pending":
        """Reduce-scatter chunk c's rows of every rank (rank-major) into `out`, this rank's chunk c (async)."""
        lengths, (_start, length) = self.lengths(c), self.own(c)
        widest = max(lengths)
        if widest == 0:
            return Pending(_DONE, lambda: rows, "wait reduce", c, self.trace)
        if min(lengths) == widest:
            work = REDUCE_SCATTER(out, rows, group=self.group, async_op=True)
            record(self.trace, "issue reduce-scatter", c)
            return Pending(work, lambda: rows, "wait reduce", c, self.trace)  # keeps `rows` alive until done
        padded = rows.new_zeros((self.tp * widest, *rows.shape[1:]))
        at = 0
        for r, n in enumerate(lengths):
            padded[r * widest:r * widest + n] = rows[at:at + n]
            at += n
        mine = rows.new_empty((widest, *rows.shape[1:]))
        work = REDUCE_SCATTER(mine, padded, group=self.group, async_op=True)
        record(self.trace, "issue reduce-scatter", c)
        return Pending(work, lambda: out.copy_(mine[:length]), "wait reduce", c, self.trace)

    def gather_all(self, local: torch.Tensor, what: str) -> list["Pending"]:
        """Every chunk's all-gather, issued at once."""
        return [self.gather(local, c, what) for c in range(self.chunks)]

    def assembled(self, pending: list["Pending"]) -> torch.Tensor:
        """The whole gathered tensor in megatron's row order, each chunk awaited."""
        whole = None
        for c, gathered in enumerate(pending):
            chunk = gathered.wait()
            if whole is None:
                whole = chunk.new_empty((self.total, *chunk.shape[1:]))
            self.place(whole, c, chunk)
        return whole


class _Done:
    @staticmethod
    def wait():
        return True


_DONE = _Done()


class Pending:
    """A collective in flight; wait() finishes it and returns its result."""

    def __init__(self, work, result, event: str, chunk: int, trace: list | None = None):
        self.work, self._result, self.event, self.chunk, self.trace = work, result, event, chunk, trace

    def wait(self):
        self.work.wait()
        record(self.trace, self.event, self.chunk)
        return self._result()


def wait_all(pending) -> None:
    for item in pending:
        item.wait()


def all_reduce(tensor: torch.Tensor, c: int, group, trace: list | None = None) -> Pending:
    """All-reduce chunk c's rows in place (async)."""
    work = dist.all_reduce(tensor, group=group, async_op=True)
    record(trace, "issue all-reduce", c)
    return Pending(work, lambda: None, "wait reduce", c, trace)
