"""The pieces both context-parallel attentions (context_parallel.py, unpadded; context_parallel_packed.py, packs)
are made of: attention blocks computed in fp32 by query rows (BLOCK_ELEMENTS score elements at a time, so no [s, s]
tensor), their log-sum-exp merge, the ring's hop and the Ulysses all-to-all. Tensors are [s, b, heads, head dim]."""

from __future__ import annotations

import torch
import torch.distributed as dist

BLOCK_ELEMENTS = 1 << 22


# --- blocks -------------------------------------------------------------------------------------------------------

def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[2] == heads else x.repeat_interleave(heads // x.shape[2], dim=2)


def _rows(sq: int, sk: int, b: int, h: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(1, sk * b * h))


def _causal_mask(start: int, rows: int, sk: int, device) -> torch.Tensor:
    """True where masked: query start + i sees keys j <= start + i (a diagonal block: queries and keys aligned)."""
    q = torch.arange(start, start + rows, device=device)[:, None]
    return torch.arange(sk, device=device)[None, :] > q


def block_forward(q, k, v, scale: float, causal: bool, masked=None):
    """One block: out [sq, b, h, d] fp32 and lse [b, h, sq] fp32 of softmax(q k^T scale) v. masked(start, rows):
    [rows, sk] True where hidden, instead of `causal` (packed sequences; a row may see no key: out 0, lse -inf)."""
    sq, b, h, _ = q.shape
    k, v = _expand_kv(k, h).float(), _expand_kv(v, h).float()
    out, lse = q.new_empty(q.shape, dtype=torch.float32), q.new_empty((b, h, sq), dtype=torch.float32)
    step = _rows(sq, k.shape[0], b, h)
    for start in range(0, sq, step):
        rows = min(step, sq - start)
        scores = torch.einsum("qbhd,kbhd->bhqk", q[start:start + rows].float(), k) * scale
        hidden = masked(start, rows) if masked is not None else \
            _causal_mask(start, rows, k.shape[0], q.device) if causal else None
        if hidden is not None:
            scores = scores.masked_fill(hidden, float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - block_lse[..., None])
        out[start:start + rows] = torch.einsum("bhqk,kbhd->qbhd", probs if masked is None else probs.nan_to_num(0.0), v)
        lse[..., start:start + rows] = block_lse
    return out, lse


def block_backward(q, k, v, dout, lse, delta, scale: float, causal: bool, masked=None):
    """Gradients of one block given the whole row's lse [b, h, sq] and delta = rowsum(dout * out) [b, h, sq]:
    dq [sq, b, h, d], dk and dv [sk, b, hk, d], all fp32 (masked: as in block_forward)."""
    sq, b, h, _ = q.shape
    hk = k.shape[2]
    kx, vx = _expand_kv(k, h).float(), _expand_kv(v, h).float()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(kx.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(vx.shape, dtype=torch.float32, device=q.device)
    step = _rows(sq, kx.shape[0], b, h)
    for start in range(0, sq, step):
        rows = slice(start, start + min(step, sq - start))
        qs, dos = q[rows].float(), dout[rows].float()
        scores = torch.einsum("qbhd,kbhd->bhqk", qs, kx) * scale
        hidden = masked(start, qs.shape[0]) if masked is not None else \
            _causal_mask(start, qs.shape[0], kx.shape[0], q.device) if causal else None
        if hidden is not None:
            scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.exp(scores - lse[..., rows, None])
        dv += torch.einsum("bhqk,qbhd->kbhd", probs, dos)
        dprobs = torch.einsum("qbhd,kbhd->bhqk", dos, vx)
        dscores = probs * (dprobs - delta[..., rows, None]) * scale
        dq[rows] = torch.einsum("bhqk,kbhd->qbhd", dscores, kx)
        dk += torch.einsum("bhqk,qbhd->kbhd", dscores, qs)
    if hk != h:
        dk, dv = (x.view(x.shape[0], b, hk, h // hk, -1).sum(3) for x in (dk, dv))
    return dq, dk, dv


def _merge(out, lse, block_out, block_lse):
    """Two partial softmax results of the same queries as one (rows with no keys yet have lse = -inf)."""
    new = torch.logaddexp(lse, block_lse)
    keep = torch.exp(lse - new).nan_to_num(0.0).permute(2, 0, 1)[..., None]
    take = torch.exp(block_lse - new).nan_to_num(0.0).permute(2, 0, 1)[..., None]
    return out * keep + block_out * take, new


def _pass_on(tensors, group):
    """Sends the tensors to the next rank of the ring and returns what the previous one sent."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    after, before = dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), after, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, before, group) for r in received]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class _AllToAll(torch.autograd.Function):
    """x [n, ...] with n = group size: part j goes to rank j; returns [n, ...] with part j from rank j."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()  # before empty_like, which would keep a permuted input's strides
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None
