"""Deterministic mock data for the driver: the same global batch in every layout."""

from __future__ import annotations


def documents_in_rows(args) -> bool:
    """--reset-attention-mask or --reset-position-ids: the GPT's rows hold documents ended by EOD tokens."""
    return bool(getattr(args, "reset_attention_mask", False) or getattr(args, "reset_position_ids", False))


def sample_length(args, gen, shortest: int = 2, skewed: bool = False) -> int:
    """--seq-length; with --mock-lengths skewed (or `skewed`), 1/16 of it (at least `shortest`) to all of it, most
    samples short (u^3), drawn from `gen`."""
    import torch

    full = args.seq_length
    if not skewed and getattr(args, "mock_lengths", "full") != "skewed":
        return full
    low = min(full, max(shortest, full // 16))
    return low + int((full - low) * float(torch.rand(1, generator=gen)) ** 3)


class MockBatches:
    """Deterministic synthetic token streams with a learnable next-token rule.

    Sample g depends only on (seed, g), so every layout sees the same global batch.
    Each sequence is an arithmetic progression over the first ALPHABET token ids with a per-sample
    start and stride, so the loss falls quickly (unigram) and keeps falling (the stride rule).
    """

    ALPHABET = 128

    def __init__(self, args, dp_rank: int, start_iteration: int = 0, device=None):
        import torch

        self.torch = torch
        self.device = device or torch.device("cpu")
        self.args = args
        self.dp_rank = dp_rank
        self.iteration = start_iteration
        self.microbatch = 0
        self.start_iteration = start_iteration

    def seek(self, position: int) -> None:
        """Next: this rank's `position`-th micro-batch from the start (a data loader worker's share)."""
        self.iteration, self.microbatch = divmod(position, self.args.num_microbatches)
        self.iteration += self.start_iteration

    def sample(self, global_index: int):
        torch = self.torch
        gen = torch.Generator().manual_seed(self.args.seed * 1_000_003 + global_index)
        vocab = min(self.args.vocab_size, self.ALPHABET)
        start = int(torch.randint(0, vocab, (1,), generator=gen))
        stride = int(torch.randint(1, 8, (1,), generator=gen))
        seq = (start + stride * torch.arange(self.length(gen) + 1)) % vocab
        return seq

    def length(self, gen) -> int:
        return sample_length(self.args, gen)

    def documents(self, global_index: int) -> dict:
        """Row `global_index` as Megatron-LM's GPT data set gives it: documents (drawn as --mock-lengths skewed
        draws samples) each ended by the EOD token, cut at --seq-length + 1 tokens; megatron.core's own function
        builds its per-document mask [1, s, s] (--reset-attention-mask) and positions (--reset-position-ids)."""
        from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

        torch = self.torch
        a = self.args
        eod = a.vocab_size - 1
        alphabet = min(eod, self.ALPHABET)
        gen = torch.Generator().manual_seed(a.seed * 1_000_003 + global_index)
        pieces, filled = [], 0
        while filled < a.seq_length + 1:
            length = max(1, sample_length(a, gen, skewed=True) // 2)
            start = int(torch.randint(0, alphabet, (1,), generator=gen))
            stride = int(torch.randint(1, 8, (1,), generator=gen))
            pieces += [(start + stride * torch.arange(length)) % alphabet, torch.tensor([eod])]
            filled += length + 1
        seq = torch.cat(pieces)[:a.seq_length + 1]
        tokens = seq[:-1].contiguous()
        mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
            tokens, eod, a.reset_position_ids, a.reset_attention_mask, False, a.reset_attention_mask)
        row = {"tokens": tokens, "labels": seq[1:].contiguous(), "position_ids": position_ids, "loss_mask": loss_mask}
        return row | ({"attention_mask": mask} if a.reset_attention_mask else {})

    def advance(self) -> None:
        self.microbatch += 1
        if self.microbatch == self.args.num_microbatches:
            self.microbatch = 0
            self.iteration += 1

    def __iter__(self):
        return self

    def __next__(self):
        torch = self.torch
        a = self.args
        base = (self.iteration * a.global_batch_size + self.microbatch * a.micro_batch_size * a.data_parallel_size
                + self.dp_rank * a.micro_batch_size)
        if documents_in_rows(a):
            rows = [self.documents(base + j) for j in range(a.micro_batch_size)]
            self.advance()
            return {name: torch.stack([row[name] for row in rows]).to(self.device) for name in rows[0]}
        samples = [self.sample(base + j) for j in range(a.micro_batch_size)]
        self.advance()
        seqs = torch.zeros(len(samples), a.seq_length + 1, dtype=torch.long)
        loss_mask = torch.zeros(len(samples), a.seq_length)
        for row, seq in enumerate(samples):  # a shorter sample (--mock-lengths skewed): padded, its loss masked
            seqs[row, :len(seq)] = seq
            loss_mask[row, :len(seq) - 1] = 1.0
        tokens = seqs[:, :-1].contiguous()
        labels = seqs[:, 1:].contiguous()
        position_ids = torch.arange(a.seq_length).unsqueeze(0).expand_as(tokens).contiguous()
        batch = {"tokens": tokens, "labels": labels, "position_ids": position_ids, "loss_mask": loss_mask}
        return {name: tensor.to(self.device) for name, tensor in batch.items()}


class ContextParallelSlices:
    """A batch iterator's batches as one context-parallel rank sees them: of each [b, s] tensor named in `split`
    (the family's context_parallel_split) its two load-balanced chunks (core.sequence_split), of every segment of a
    pack."""

    def __init__(self, batches, cp_rank: int, cp_size: int, split: tuple[str, ...]):
        self.batches, self.cp_rank, self.cp_size, self.split = batches, cp_rank, cp_size, split

    def __getattr__(self, name):  # start_step, microbatches_this_step, seek, ... of the wrapped iterator
        return getattr(self.batches, name)

    def __iter__(self):
        return self

    def __next__(self):
        from mm_adaptor.core.sequence_split import context_parallel_part

        batch = next(self.batches)
        packed = batch.get("packed_seq_params")  # a pack keeps the whole pack's bounds
        return {name: context_parallel_part(t, self.cp_rank, self.cp_size, packed, dim=1) if name in self.split else t
                for name, t in batch.items()}
