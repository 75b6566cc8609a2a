"""Tensor-parallel peers take their batches from the group's first rank (train.tp_broadcast): on 2 gloo ranks at
TP2, rank 1's own source (which would give other pixels) is never read and it trains on rank 0's bytes; the broken
variant, where each peer reads its own source, is caught by the same comparison."""

import pytest

from gloo_rank import a_rank, model_parallel, run_ranks

pytestmark = pytest.mark.distributed


class _Source:
    """Batches whose pixels differ by rank (a peer decoding different pixels); counts what was read."""

    def __init__(self, rank):
        self.rank, self.read = rank, 0

    def __next__(self):
        import torch

        from megatron.core.packed_seq_params import PackedSeqParams

        self.read += 1
        ids = torch.arange(12).reshape(2, 6) + self.read
        return {"input_ids": ids, "position_ids": torch.arange(6).expand(3, 2, 6),  # not contiguous
                "pixel_values": torch.full((4 + self.read, 8), float(self.rank * 100 + self.read)),
                "image_grid_thw": None, "packed_seq_params": PackedSeqParams(qkv_format="thd",
                                                                             cu_seqlens_q=torch.tensor([0, 6]))}


class _PackedSource(_Source):
    """A step of packs: the first rank's steps make 2, 3, 1 packs; another rank's own would make 5 each."""

    def __init__(self, rank):
        super().__init__(rank)
        self.steps, self.microbatches_this_step, self.tokens_this_step = 0, 0, 0

    def start_step(self):
        self.steps += 1
        self.microbatches_this_step = (2, 3, 1)[self.steps - 1] if self.rank == 0 else 5
        self.tokens_this_step = 10 * self.microbatches_this_step


def _rank_main(workdir):
    import torch

    from megatron.core import parallel_state as ps

    from mm_adaptor.train import tp_broadcast

    with a_rank(workdir) as (_, results), model_parallel(2):
        for variant in ("broadcast", "broken"):  # broken: each peer reads its own source
            source = _Source(torch.distributed.get_rank())
            batches = source if variant == "broken" else tp_broadcast.TensorParallelBroadcast(
                source, ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank(), "cpu")
            got = [next(batches) for _ in range(3)]
            results[variant] = {"batches": [{k: v for k, v in b.items() if k != "packed_seq_params"} for b in got],
                                "cu_seqlens": [b["packed_seq_params"].cu_seqlens_q for b in got],
                                "read": source.read}
        source = _PackedSource(torch.distributed.get_rank())
        packs = tp_broadcast.TensorParallelBroadcast(source, ps.get_tensor_model_parallel_group(),
                                                     ps.get_tensor_model_parallel_src_rank(), "cpu", packed=True)
        steps = []
        for _ in range(3):
            packs.start_step()
            steps.append((packs.microbatches_this_step, packs.tokens_this_step,
                          [next(packs)["input_ids"] for _ in range(packs.microbatches_this_step)]))
        results["packed"] = {"steps": steps, "read": source.read, "packed_steps": source.steps}


def _same(a, b) -> bool:
    import torch

    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for one, other in zip(a, b) for x, y in ((one[k], other[k]) for k in one))


def test_tensor_parallel_peers_train_on_the_first_ranks_batches(tmp_path):
    ranks = run_ranks(_rank_main, tmp_path, {})
    first, second = (rank["broadcast"] for rank in ranks)
    assert (first["read"], second["read"]) == (3, 0)  # the peer's own source is never read
    assert _same(first["batches"], second["batches"]) and first["batches"][2]["pixel_values"].shape == (7, 8)
    assert all(a.equal(b) for a, b in zip(first["cu_seqlens"], second["cu_seqlens"]))
    first, second = (rank["broken"] for rank in ranks)
    assert not _same(first["batches"], second["batches"])
    first, second = (rank["packed"] for rank in ranks)  # packs: the first rank packs, the peer learns the count
    assert [(n, t) for n, t, _ in first["steps"]] == [(n, t) for n, t, _ in second["steps"]] == [(2, 20), (3, 30),
                                                                                                  (1, 10)]
    assert all(a.equal(b) for one, other in zip(first["steps"], second["steps"]) for a, b in zip(one[2], other[2]))
    assert (first["read"], first["packed_steps"], second["read"], second["packed_steps"]) == (6, 3, 0, 0)
