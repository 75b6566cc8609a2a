"""Deterministic mock data for the driver: the same global batch in every layout."""

from __future__ import annotations


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

    def sample(self, global_index: int):
        torch = self.torch
        gen = torch.Generator().manual_seed(self.args.seed * 1_000_003 + global_index)
        vocab = min(self.args.vocab_size, self.ALPHABET)
        start = int(torch.randint(0, vocab, (1,), generator=gen))
        stride = int(torch.randint(1, 8, (1,), generator=gen))
        seq = (start + stride * torch.arange(self.args.seq_length + 1)) % vocab
        return seq

    def __iter__(self):
        return self

    def __next__(self):
        torch = self.torch
        a = self.args
        base = (self.iteration * a.global_batch_size + self.microbatch * a.micro_batch_size * a.data_parallel_size
                + self.dp_rank * a.micro_batch_size)
        seqs = torch.stack([self.sample(base + j) for j in range(a.micro_batch_size)])
        self.microbatch += 1
        if self.microbatch == a.num_microbatches:
            self.microbatch = 0
            self.iteration += 1
        tokens = seqs[:, :-1].contiguous()
        labels = seqs[:, 1:].contiguous()
        position_ids = torch.arange(a.seq_length).unsqueeze(0).expand_as(tokens).contiguous()
        loss_mask = torch.ones_like(tokens, dtype=torch.float)
        batch = {"tokens": tokens, "labels": labels, "position_ids": position_ids, "loss_mask": loss_mask}
        return {name: tensor.to(self.device) for name, tensor in batch.items()}
