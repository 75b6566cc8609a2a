"""Several data sets drawn with weights, Megatron's way: `--data-path W1 P1 W2 P2 ...` (or `P1 P2 ...`, weighted by
their sizes).

Position p of the blended stream goes to the data set whose share is furthest behind its weight: the one with the
largest w_d * max(p, 1) - (its draws before p), ties to the first, computed by Megatron's own helper
(megatron.core.datasets.helpers_cpp.build_blending_indices, as its BlendedDataset does). Each data set's k-th
draw is sample k of its own endless stream of seeded per-epoch permutations. Every prefix of the stream holds each
data set within one sample of its weight, and a position's sample depends on nothing but the position: any
data-parallel size and any resume read the same."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mm_adaptor.data.records import DataError

BLOCK = 1 << 16  # stream positions assigned at a time


def parse_blend(paths) -> list[tuple[float | None, str]]:
    """[(weight or None, path)] of Megatron's --data-path list: one path, weight-path pairs, or paths alone."""
    paths = [str(p) for p in paths]
    weights = paths[0::2]
    try:
        numbers = [float(w) for w in weights]
    except ValueError:
        numbers = None
    if len(paths) > 1 and numbers is not None:
        if len(paths) % 2:
            raise DataError(f"--data-path {' '.join(paths)}: weights and paths come in pairs (W1 P1 W2 P2 ...)")
        if any(w < 0 for w in numbers) or not sum(numbers):
            raise DataError(f"--data-path {' '.join(paths)}: the weights must be 0 or more, not all 0")
        return list(zip(numbers, paths[1::2]))
    return [(None, p) for p in paths]


class BlendedSamples(Sequence):
    """The samples of several data sets as one sequence (data set d's at offsets[d] on), with the blended stream
    over them (stream_index)."""

    def __init__(self, components, weights=None):
        self.components = list(components)
        sizes = np.array([len(c) for c in self.components], dtype=np.float64)
        raw = sizes if weights is None else np.array(weights, dtype=np.float64)
        raw = np.where(sizes > 0, raw, 0.0)  # a data set without samples (in this split) is never drawn
        if not raw.sum():
            raise DataError("the blended data sets have no samples")
        self.weights = raw / raw.sum()
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._sets = np.zeros(0, dtype=np.int16)
        self._draws = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i):
        if isinstance(i, slice):
            raise TypeError("blended samples are split per data set before blending")
        i = int(i) + (len(self) if int(i) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        d = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.components[d][i - int(self.offsets[d])]

    @property
    def key(self) -> str:
        return "+".join(f"{w:.6g}x{getattr(c, 'key', len(c))}" for w, c in zip(self.weights, self.components))

    def assignment(self, position: int) -> tuple[int, int]:
        """(data set, its draw number) of a stream position."""
        while position >= len(self._sets):
            self._assign_block()
        return int(self._sets[position]), int(self._draws[position])

    def stream_index(self, position: int, seed: int) -> int:
        """The sample (an index of this sequence) at a stream position."""
        from mm_adaptor.data.vlm import stream_index

        d, draw = self.assignment(position)
        return int(self.offsets[d]) + stream_index(self.components[d], draw, seed * 7919 + d)

    def _assign_block(self) -> None:
        """The assignment of the stream's first len + BLOCK positions, by Megatron's own helper (recomputed from
        position 0: the greedy order depends on every earlier draw)."""
        from megatron.core.datasets import helpers_cpp

        size = len(self._sets) + BLOCK
        sets, draws = np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64)
        helpers_cpp.build_blending_indices(sets, draws, self.weights, len(self.components), size, False)
        self._sets, self._draws = sets, draws
