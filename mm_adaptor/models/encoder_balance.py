"""--encoder-dp-balance (MindSpeed-MM's name): the vision encoder's images spread over the data-parallel group (with
its context-parallel ranks) by patch count, so that each rank's encoder work is even; the embeddings go back to the
ranks that hold their samples.

A rank's images are its home's: its data-parallel rank's micro-batch. The context-parallel ranks of one home hold
the same images and each needs all their rows (it cuts its part of the sequence after placing them); unbalanced, each
encodes all of them. Per micro-batch and visual kind (images, videos), every rank of the group:
1. shares its images' grids and its home (all-gather: counts and homes, then the [t, h, w] rows);
2. assigns the images of every home to ranks, longest first, each to the rank with the fewest patches so far (ties:
   a rank of the image's home, then the lowest rank); the same on every rank, from the same grids;
3. sends the pixels of images assigned outside their home (an all-to-all of patch rows; pixels need no gradient);
4. runs the encoder on the images it was given, in (source rank, image) order;
5. returns the embeddings to every rank of their home with an all-to-all whose backward sends their gradients
   back to the rank that computed them (summed over the home's ranks), so a trainable encoder learns from every
   image as without the balance.

Each image's encoder work is its own (attention within the image, row-wise layers), so the result equals the
unbalanced run up to the rounding of products over other row counts; the gradients summed over the data-parallel
(and context-parallel) ranks are the same sums. A family whose encoder returns more than rows (Qwen3-VL's DeepStack
features) is refused before any rank starts. Statistics per rank (patches before and after, images moved out of
their home) are in BALANCE."""

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


def assign(grids: list[list[tuple[int, int, int]]], holders: list[list[int]] | None = None) -> list[list[int]]:
    """owner[home][image]: the rank that encodes each image of each home (longest processing time first). A home's
    images are held by the ranks holders[home] (default: rank `home` alone); on ties an image goes to a holder, the
    least loaded first, so even loads move nothing."""
    holders = holders or [[home] for home in range(len(grids))]
    load = [0] * (1 + max(r for rs in holders for r in rs))
    owner = [[0] * len(g) for g in grids]
    images = [(t * h * w, home, i) for home, g in enumerate(grids) for i, (t, h, w) in enumerate(g)]
    for patches, home, i in sorted(images, key=lambda x: (-x[0], x[2], x[1])):  # homes in turn: equal loads stay
        least = min(load)
        at_home = [r for r in holders[home] if load[r] == least]
        chosen = at_home[0] if at_home else load.index(least)
        owner[home][i] = chosen
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


def _gather_grids(grid, pixels, home: int, group, device):
    """Every rank's image grids, every rank's home, and the length of a pixel row (from any rank with pixels)."""
    size = dist.get_world_size(group)
    mine = torch.zeros(0, 4, dtype=torch.long, device=device)
    if grid is not None and grid.shape[0]:
        mine = torch.cat([grid.to(device=device, dtype=torch.long),
                          torch.full((grid.shape[0], 1), pixels.shape[-1], dtype=torch.long, device=device)], dim=1)
    counts = [torch.zeros(2, dtype=torch.long, device=device) for _ in range(size)]
    dist.all_gather(counts, torch.tensor([mine.shape[0], home], dtype=torch.long, device=device), group=group)
    padded = torch.zeros(max(int(c[0]) for c in counts), 4, dtype=torch.long, device=device)
    padded[:mine.shape[0]] = mine
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    rows = [g[:int(c[0])].tolist() for g, c in zip(gathered, counts)]
    width = max((r[3] for g in rows for r in g), default=0)
    return [[tuple(r[:3]) for r in g] for g in rows], [int(c[1]) for c in counts], width


def balanced_rows(encode, pixels, grid, group, *, merge: int, hidden: int, dtype, trainable: bool, device,
                  home: int | None = None, return_order=None):
    """The rows [visual tokens of this rank's images, hidden] in image order, the images encoded where assign() put
    them: encode(pixels, grid) -> rows. Every rank of `group` calls it for every micro-batch and visual kind, with or
    without images (pixels None). home: which images this rank holds (its data-parallel rank; default its rank in
    the group): ranks with one home (context-parallel ranks) hold the same images, share the work of encoding them
    and each get all their rows. merge: patches per row (the spatial merge size squared); dtype and trainable: the
    encoder's output's, for a rank that encodes nothing. return_order: only for the broken variant that hands rows
    back to the wrong images."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    grids_of_rank, home_of, width = _gather_grids(grid, pixels, me if home is None else home, group, device)
    homes = sorted(set(home_of))
    holders = [[r for r in range(size) if home_of[r] == h] for h in homes]
    grids = [grids_of_rank[rs[0]] for rs in holders]
    mine = homes.index(home_of[me])
    owner = assign(grids, holders)
    patches = [[t * h * w for t, h, w in g] for g in grids]
    images = [(h, i) for h in range(len(homes)) for i in range(len(grids[h]))]

    def sender(h, i):  # who sends an image's pixels to its owner: the owner if it holds them, else one holder
        return owner[h][i] if owner[h][i] in holders[h] else holders[h][i % len(holders[h])]

    # pixels out, to each rank its images in (home, image) order (fp32 in transit: exact for any pixel dtype; the
    # encoder casts to its own)
    pieces = list(pixels.float().split(patches[mine])) if patches[mine] else []
    sent = [[(h, i) for h, i in images if sender(h, i) == me and owner[h][i] == a] for a in range(size)]
    outgoing = [pieces[i] for a in range(size) for _, i in sent[a]]
    out = torch.cat(outgoing) if outgoing else torch.zeros(0, width, device=device)
    kept = [[(h, i) for h, i in images if sender(h, i) == s and owner[h][i] == me] for s in range(size)]
    send = [sum(patches[h][i] for h, i in sent[a]) for a in range(size)]
    receive = [sum(patches[h][i] for h, i in kept[s]) for s in range(size)]
    given = torch.empty(sum(receive), width, device=device)
    dist.all_to_all_single(given, out.contiguous(), receive, send, group=group)
    # the encoder on the images given to this rank, by source rank then image
    kept = [hi for s in range(size) for hi in kept[s]]
    if kept:
        rows = encode(given, torch.tensor([grids[h][i] for h, i in kept], dtype=torch.long, device=device))
    else:
        rows = torch.zeros(0, hidden, dtype=dtype, device=device, requires_grad=trainable)
    # rows home: to every holder of an image its rows; they arrive by encoding rank, then image
    rows_of = [[p // merge for p in ps] for ps in patches]
    encoded = dict(zip(kept, rows.split([rows_of[h][i] for h, i in kept])))
    back = [[hi for hi in images if hi in encoded and a in holders[hi[0]]] for a in range(size)]  # by image
    outgoing = [encoded[hi] for a in range(size) for hi in back[a]]
    out = torch.cat(outgoing) if outgoing else rows[:0]
    arriving = [[(mine, i) for i in range(len(grids[mine])) if owner[mine][i] == a] for a in range(size)]
    arrived = _Exchange.apply(out, [sum(rows_of[h][i] for h, i in b) for b in back],
                              [sum(rows_of[h][i] for h, i in a) for a in arriving], group)
    order = [i for a in range(size) for _, i in arriving[a]]
    if return_order is not None:
        order = return_order(order)
    returned = dict(zip(order, arrived.split([rows_of[mine][i] for i in order])))
    before = [sum(patches[homes.index(home_of[r])]) for r in range(size)]
    after = [sum(patches[h][i] for h, i in images if owner[h][i] == a) for a in range(size)]
    BALANCE.add(before, after, sum(owner[h][i] not in holders[h] for h, i in images))
    return torch.cat([returned[i] for i in range(len(rows_of[mine]))]) if returned else arrived
