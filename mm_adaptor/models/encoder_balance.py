"""--encoder-dp-balance (MindSpeed-MM's name): the vision encoder's images spread over the data-parallel group by
patch count, so that each rank's encoder work is even; the embeddings go back to their samples' ranks.

Per micro-batch and visual kind (images, videos), every rank of the group:
1. shares its images' grids (all-gather: counts, then the [t, h, w] rows);
2. assigns the group's images to ranks, longest first, each to the rank with the fewest patches so far (ties: the
   image's own rank, then the lowest rank); the same on every rank, from the same grids;
3. sends the pixels of the images assigned elsewhere (an all-to-all of patch rows; pixels need no gradient);
4. runs the encoder on the images it was given, in (source rank, image) order;
5. returns the embeddings with an all-to-all whose backward sends their gradients back to the rank that computed
   them, so a trainable encoder learns from every image as without the balance.

Each image's encoder work is its own (attention within the image, row-wise layers), so the result equals the
unbalanced run up to the rounding of products over other row counts; the gradients summed over data-parallel
ranks are the same sums. A family whose encoder returns more than rows (Qwen3-VL's DeepStack features) is refused
before any rank starts. Statistics per rank (patches before and after, images moved) are in BALANCE."""

from __future__ import annotations

import torch
import torch.distributed as dist


class BalanceStatistics:
    def __init__(self):
        self.calls, self.images_moved = 0, 0
        self.per_call: list[tuple[list[int], list[int]]] = []  # (patches per rank before, after) of each exchange

    def add(self, before: list[int], after: list[int], moved: int) -> None:
        self.calls += 1
        self.images_moved += moved
        self.per_call.append((before, after))

    def as_dict(self) -> dict:
        before = [sum(column) for column in zip(*(b for b, _ in self.per_call))]
        after = [sum(column) for column in zip(*(a for _, a in self.per_call))]
        return {"calls": self.calls, "images_moved": self.images_moved, "patches_before": before,
                "patches_after": after, "per_call": self.per_call}


BALANCE = BalanceStatistics()


class EncoderClock:
    """Seconds this rank spent in the vision encoder, per call (host time: on a GPU, without a synchronisation, the
    launch time), for the balance's benchmark; the driver reports them as memory["encoder_seconds"]."""

    def __init__(self):
        self.per_call: list[float] = []

    @property
    def seconds(self) -> float:
        return sum(self.per_call)

    def timed(self, encode, *args):
        import time

        start = time.perf_counter()
        try:
            return encode(*args)
        finally:
            self.per_call.append(time.perf_counter() - start)


ENCODER_CLOCK = EncoderClock()


def assign(grids: list[list[tuple[int, int, int]]]) -> list[list[int]]:
    """owner[rank][image]: the rank that encodes each image of each rank (longest processing time first)."""
    size = len(grids)
    load = [0] * size
    owner = [[0] * len(g) for g in grids]
    images = [(t * h * w, rank, i) for rank, g in enumerate(grids) for i, (t, h, w) in enumerate(g)]
    for patches, rank, i in sorted(images, key=lambda x: (-x[0], x[2], x[1])):  # ranks in turn: equal loads stay
        least = min(load)
        chosen = rank if load[rank] == least else load.index(least)
        owner[rank][i] = chosen
        load[chosen] += patches
    return owner


class _Exchange(torch.autograd.Function):
    """Rows to other ranks (all-to-all with sizes); backward returns their gradients the same way back."""

    @staticmethod
    def forward(ctx, x, send: list[int], receive: list[int], group):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return out, None, None, None


def _gather_grids(grid, pixels, group, device) -> tuple[list[list[tuple[int, int, int]]], int]:
    """Every rank's image grids, and the length of a pixel row (from any rank that has pixels)."""
    size = dist.get_world_size(group)
    mine = torch.zeros(0, 4, dtype=torch.long, device=device)
    if grid is not None and grid.shape[0]:
        mine = torch.cat([grid.to(device=device, dtype=torch.long),
                          torch.full((grid.shape[0], 1), pixels.shape[-1], dtype=torch.long, device=device)], dim=1)
    counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(size)]
    dist.all_gather(counts, torch.tensor([mine.shape[0]], dtype=torch.long, device=device), group=group)
    padded = torch.zeros(max(int(c) for c in counts), 4, dtype=torch.long, device=device)
    padded[:mine.shape[0]] = mine
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    rows = [g[:int(c)].tolist() for g, c in zip(gathered, counts)]
    width = max((r[3] for g in rows for r in g), default=0)
    return [[tuple(r[:3]) for r in g] for g in rows], width


def balanced_rows(encode, pixels, grid, group, *, merge: int, hidden: int, dtype, trainable: bool, device,
                  return_order=None):
    """The rows [visual tokens of this rank's own images, hidden] in image order, the images encoded where
    assign() put them: encode(pixels, grid) -> rows. Every rank of `group` calls it for every micro-batch and visual
    kind, with or without images (pixels None). merge: patches per row (the spatial merge size squared); dtype and
    trainable: the encoder's output's, for a rank that encodes nothing. return_order: only for the broken variant
    that hands rows back to the wrong images."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    grids, width = _gather_grids(grid, pixels, group, device)
    owner = assign(grids)
    patches = [[t * h * w for t, h, w in g] for g in grids]
    # pixels out, to each rank its images in image order (fp32 in transit: exact for any pixel dtype; the encoder
    # casts to its own)
    mine = list(pixels.float().split(patches[me])) if patches[me] else []
    send = [sum(p for p, o in zip(patches[me], owner[me]) if o == a) for a in range(size)]
    receive = [sum(p for p, o in zip(patches[s], owner[s]) if o == me) for s in range(size)]
    outgoing = [mine[i] for a in range(size) for i, o in enumerate(owner[me]) if o == a]
    out = torch.cat(outgoing) if outgoing else torch.zeros(0, width, device=device)
    given = torch.empty(sum(receive), width, device=device)
    dist.all_to_all_single(given, out.contiguous(), receive, send, group=group)
    # the encoder on the images given to this rank, by source rank then image
    kept = [(s, i) for s in range(size) for i, o in enumerate(owner[s]) if o == me]
    if kept:
        rows = encode(given, torch.tensor([grids[s][i] for s, i in kept], dtype=torch.long, device=device))
    else:
        rows = torch.zeros(0, hidden, dtype=dtype, device=device, requires_grad=trainable)
    # rows home: to each source rank its images' rows; they arrive by encoding rank, then image
    rows_of = [[p // merge for p in ps] for ps in patches]
    back = [sum(rows_of[s][i] for s2, i in kept if s2 == s) for s in range(size)]
    home = [sum(r for r, o in zip(rows_of[me], owner[me]) if o == a) for a in range(size)]
    arrived = _Exchange.apply(rows, back, home, group)
    order = [i for a in range(size) for i, o in enumerate(owner[me]) if o == a]
    if return_order is not None:
        order = return_order(order)
    pieces = dict(zip(order, arrived.split([rows_of[me][i] for i in order])))
    before = [sum(p) for p in patches]
    after = [sum(p for s in range(size) for p, o in zip(patches[s], owner[s]) if o == a) for a in range(size)]
    BALANCE.add(before, after, sum(o != r for r, os in enumerate(owner) for o in os))
    return torch.cat([pieces[i] for i in range(len(rows_of[me]))]) if pieces else arrived
