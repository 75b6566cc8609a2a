"""Megatron-LM's per-document attention masks (--reset-attention-mask) as segments of the varlen attention op.

With --reset-attention-mask Megatron-LM's data loader (megatron.core.datasets.gpt_dataset's
_get_ltor_masks_and_position_ids) gives each row a boolean [s, s] mask, True where a query may not see a key: causal
within each document, blocked across every EOD. Megatron's local attention computes the whole [s, s] scores and
masks them. A mask of exactly that form is a row of causal segments, so --use-flash-attn runs
mm_adaptor.ops.varlen_attention on them instead: no [s, s] scores, and on an NPU npu_fusion_attention's TND layout
(MindSpeed's path for the same flags). The segments are read from the mask's subdiagonal, and the whole mask is
compared with the block-diagonal causal mask they define, once per mask tensor (a forward's layers share one); any
other mask goes whole to the attention kernel, after one warning.
"""

from __future__ import annotations

import warnings
from itertools import accumulate

import torch

from mm_adaptor.core.recent import RecentByIdentity

ROWS_PER_COMPARISON = 1024  # the comparison builds at most this many rows of the expected mask at a time


def document_lengths(mask: torch.Tensor) -> list[list[int]] | None:
    """The documents' lengths of each row of a boolean [n, 1, s, s] mask (True: masked) when every row is
    block-diagonal causal, else None. Compared on the mask's device; one copy to the host per mask."""
    n, s = mask.shape[0], mask.shape[-1]
    rows_of = mask[:, 0]
    starts = torch.zeros(n, s, dtype=torch.bool, device=mask.device)
    starts[:, 1:] = rows_of.diagonal(-1, dim1=-2, dim2=-1)
    document = starts.cumsum(-1)
    keys = torch.arange(s, device=mask.device)
    same = torch.ones(n, dtype=torch.bool, device=mask.device)
    for first in range(0, s, ROWS_PER_COMPARISON):
        rows = keys[first:first + ROWS_PER_COMPARISON]
        expected = (document[:, rows, None] != document[:, None, :]) | (keys > rows[:, None])
        same &= (rows_of[:, first:first + ROWS_PER_COMPARISON] == expected).flatten(1).all(-1)
    on_host = torch.cat([same[:, None], starts], dim=1).cpu()
    if not bool(on_host[:, 0].all()):
        return None
    lengths = []
    for row in on_host[:, 1:]:
        bounds = [0, *torch.nonzero(row).flatten().tolist(), s]
        lengths.append([b - a for a, b in zip(bounds, bounds[1:])])
    return lengths


class Segments:
    """A batch's documents as one THD pack, the rows one after another. The bounds live on the host, so that no
    layer reads the device for them (an NPU's kernel takes them as a list); CUDA's varlen kernel gets one device copy
    per mask."""

    def __init__(self, lengths: list[int]):
        self.bounds = list(accumulate(lengths, initial=0))
        self.cu_seqlens = torch.tensor(self.bounds, dtype=torch.int32)
        self.longest = max(lengths)
        self._copies: dict = {}

    def bounds_for(self, device: torch.device) -> torch.Tensor:
        from mm_adaptor.ops.varlen_attention import bounds_for_kernel

        if device not in self._copies:
            self._copies[device] = bounds_for_kernel(self.cu_seqlens, device)
        return self._copies[device]


class DocumentAttention:
    """Per-document masks recognised (cached per mask tensor), and the varlen calls made on them (tests read
    `calls` and `last_cu_seqlens` through the driver's memory figures)."""

    def __init__(self):
        self._read_masks = RecentByIdentity()
        self.calls, self.last_cu_seqlens, self.warned = 0, None, False

    def segments(self, mask, batch: int, sq: int, sk: int) -> Segments | None:
        if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
            return None
        if sq != sk or tuple(mask.shape[-2:]) != (sq, sk) or mask.shape[0] not in (1, batch):
            return None
        return self._read_masks.get(mask, lambda m: self._read(m, batch), version=mask._version)

    def _read(self, mask, batch: int) -> Segments | None:
        rows = document_lengths(mask)
        if rows is None:
            if not self.warned:
                self.warned = True
                warnings.warn("--use-flash-attn with --reset-attention-mask: an attention mask is not a per-document "
                              "causal mask (a data loader of its own?); such masks go whole to the attention kernel",
                              RuntimeWarning, stacklevel=5)
            return None
        if len(rows) == 1:
            rows = rows * batch
        return Segments([n for lengths in rows for n in lengths])

    def attend(self, query, key, value, segments: Segments, scale: float):
        """Causal attention within each document: query [s, b, np, hn], key/value [s, b, ng, hn] -> [s, b, np*hn]."""
        from mm_adaptor.ops.varlen_attention import varlen_attention

        s, b = query.shape[:2]

        def rows_in_a_row(t):
            return t.transpose(0, 1).reshape(b * s, *t.shape[2:])

        cu_seqlens = segments.bounds_for(query.device)
        context = varlen_attention(rows_in_a_row(query), rows_in_a_row(key), rows_in_a_row(value), cu_seqlens,
                                   cu_seqlens, segments.longest, segments.longest, causal=True, softmax_scale=scale)
        self.calls += 1
        self.last_cu_seqlens = segments.bounds
        return context.reshape(b, s, -1).transpose(0, 1).contiguous()


DOCUMENTS = DocumentAttention()  # the process's one: --use-flash-attn with --reset-attention-mask serves masks by it
