"""--packing: the samples of a step packed into micro-batches of at most --seq-length tokens.

The window: each step, a data-parallel rank packs the samples it reads in that step (its share of
--global-batch-size: the very samples an unpacked run with --micro-batch-size 1 gives it), longest first, each into
the first micro-batch with room (first-fit decreasing; ties by sample order). So a step trains on the same samples
packed or not, the loss per token is over the same tokens, and the number of micro-batches of a step is the number
of packs (the driver passes it to megatron's schedule). A sample is a function of (seed, global index) only, so
packing is deterministic for a seed and a resumed run packs the steps it did not train exactly as the first run
would have.

A pack is one row of exactly --seq-length tokens (the pipeline's tensors keep one shape): the samples back to
back, then, if room is left, one padding segment (token 0, loss masked). Positions restart at 0 in every sample
(for the VLMs each sample's 3-D rope index); cu_seqlens [samples (+1) + 1] bound the segments; megatron's
PackedSeqParams (qkv_format "thd") carry them to the attention (patches/transformer/packed_attention.py).

At --context-parallel-size N each sample first grows to a multiple of 2 x N tokens (loss-masked padding) and is packed
by that length, so that every segment splits into equal chunks over the CP ranks (train.data.ContextParallelSlices);
PackedSeqParams then carry the samples' bounds in cu_seqlens_q and the segments' in cu_seqlens_q_padded.

max_seqlen is the longest segment, never the pack's length: megatron's THD rope (rope_utils, 0.16 to 0.19) reads
frequencies of the pack's length as continuous positions across samples; of the longest segment's, as positions
restarted per sample. (Multimodal rope frequencies are per token already: the pack's length, taken as given.)
"""

from __future__ import annotations

# a VLM sample's visual inputs, in the model's keyword names (None where the sample has none)
VISUAL_FIELDS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")

TEXT_FIELDS = ("tokens", "labels", "loss_mask")


class SampleTooLong(ValueError):
    pass


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of at most `capacity`: longest first (ties by index), each into the
    first bin with room; bins in the order they were opened, members in the order they were placed."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if length > capacity:
            raise SampleTooLong(f"sample {index} has {length} tokens, more than the {capacity} of a pack")
        for b, free in enumerate(room):
            if length <= free:
                bins[b].append(index)
                room[b] -= length
                break
        else:
            bins.append([index])
            room.append(capacity - length)
    return bins


def restarted_positions(lengths: list[int]):
    """[sum(lengths)] positions 0..L-1 of each sample in turn."""
    import torch

    return torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)


def cu_seqlens_of(lengths: list[int]):
    import torch

    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu


def packed_seq_params(lengths: list[int], device=None, real: list[int] | None = None):
    """megatron's PackedSeqParams (THD) of segments `lengths` (the padding segment included). real: the samples'
    own lengths where each segment was padded to split over the context-parallel ranks (megatron's convention then:
    cu_seqlens_q the samples', cu_seqlens_q_padded the segments')."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens_of(lengths).to(device)
    longest = max(lengths)
    if real is None:
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                               max_seqlen_kv=longest)
    own = cu_seqlens_of(real).to(device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=own, cu_seqlens_kv=own, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest)


def padded_for_context_parallel(sample: dict, cp_size: int) -> dict:
    """A text sample grown to a multiple of 2 x cp_size tokens (its segment splits into equal chunks over the CP
    ranks): padding tokens 0, loss masked, positions running on; "real_length" keeps its own length."""
    import torch

    from mm_adaptor.core.sequence_split import padded_length

    length = int(sample["tokens"].shape[-1])
    extra = padded_length(length, cp_size) - length
    grown = {name: torch.cat([sample[name], torch.zeros(extra, dtype=sample[name].dtype)]) for name in TEXT_FIELDS}
    positions = sample["position_ids"]  # [L], or a VLM's [3, L]: the padding's run on from the last
    after = int(positions.max()) + 1 if length else 0
    tail = torch.arange(after, after + extra, dtype=positions.dtype).expand(*positions.shape[:-1], extra)
    grown["position_ids"] = torch.cat([positions, tail], dim=-1)
    return {**sample, **grown, "real_length": length}


def pack(samples: list[dict], capacity: int) -> dict:
    """One micro-batch [1, capacity] of `samples`: each a dict of tokens, labels, loss_mask [L] and position_ids
    [L] (or [3, L]), optionally VISUAL_FIELDS (pixel_values [patches, dim], image_grid_thw [images, 3], and the
    videos' alike). Adds the padding
    segment; "segments" holds the lengths (padding included), "tokens_real" the samples' tokens."""
    import torch

    lengths = [int(s["tokens"].shape[-1]) for s in samples]
    used = sum(lengths)
    if used > capacity:
        raise SampleTooLong(f"{used} tokens do not fit a pack of {capacity}")
    pad = capacity - used
    batch = {}
    for name in TEXT_FIELDS:
        parts = [s[name] for s in samples]
        if pad:
            parts.append(torch.zeros(pad, dtype=parts[0].dtype))
        batch[name] = torch.cat(parts).unsqueeze(0)
    positions = [s["position_ids"] for s in samples]
    if pad:
        positions.append(restarted_positions([pad]).expand(*positions[0].shape[:-1], pad))
    batch["position_ids"] = torch.cat(positions, dim=-1).unsqueeze(-2)  # [1, S] or [3, 1, S]
    for name in VISUAL_FIELDS:
        parts = [s[name] for s in samples if s.get(name) is not None]
        if parts or name in samples[0]:
            batch[name] = torch.cat(parts) if parts else None
    batch["segments"] = lengths + ([pad] if pad else [])
    batch["tokens_real"] = used
    if any("real_length" in s for s in samples):
        batch["segments_real"] = [s.get("real_length", n) for s, n in zip(samples, lengths)] + ([pad] if pad else [])
    return batch


class PackedBatches:
    """This data-parallel rank's packed micro-batches, step by step, from `sample(global index)` (a dict as
    `pack` takes). The driver calls start_step() before each step and reads microbatches_this_step."""

    def __init__(self, args, dp_rank: int, start_iteration: int, device, sample, step_indices=None):
        """step_indices(iteration): the indices `sample` takes for this rank's step, where the source orders its
        stream otherwise than the mock data (e.g. a data set's rank-contiguous share); default step_indices below."""
        self.args, self.dp_rank, self.device, self.sample = args, dp_rank, device, sample
        self.source_indices = step_indices
        self.iteration = start_iteration
        self.start_iteration = start_iteration
        self.queue: list[dict] = []
        self.microbatches_this_step = 0
        self.tokens_this_step = 0  # non-padding tokens this rank packs in the current step
        self.padding_this_step = 0

    def __getattr__(self, name):
        """failed, bad_limit: those of the source `sample` belongs to (a data set's samples that failed to load)."""
        if name in ("failed", "bad_limit"):
            return getattr(getattr(self.sample, "__self__", None), name)
        raise AttributeError(name)

    def step_indices(self, iteration: int) -> list[int]:
        """The global indices this rank reads in `iteration`: those of an unpacked run with micro-batch 1."""
        a = self.args
        dp = a.data_parallel_size
        return [iteration * a.global_batch_size + m * dp + self.dp_rank for m in range(a.global_batch_size // dp)]

    def seek(self, position: int) -> None:
        """Next: the `position`-th step from the start (a data loader worker's share of whole steps)."""
        self.iteration = self.start_iteration + position
        self.queue = []

    def start_step(self) -> None:
        indices = (self.source_indices or self.step_indices)(self.iteration)
        samples = [self.sample(i) for i in indices]
        tokens = sum(int(s["tokens"].shape[-1]) for s in samples)
        cp = getattr(self.args, "context_parallel_size", 1) or 1
        if cp > 1:
            samples = [padded_for_context_parallel(s, cp) for s in samples]
        lengths = [int(s["tokens"].shape[-1]) for s in samples]
        bins = first_fit_decreasing(lengths, self.args.seq_length)
        self.queue = [pack([samples[i] for i in members], self.args.seq_length) for members in bins]
        self.microbatches_this_step = len(self.queue)
        self.tokens_this_step = tokens
        self.padding_this_step = len(self.queue) * self.args.seq_length - self.tokens_this_step
        self.iteration += 1

    def __iter__(self):
        return self

    def __next__(self):
        if not self.queue:
            raise RuntimeError(f"all {self.microbatches_this_step} packs of the step were read: call start_step() "
                               "before each step and read microbatches_this_step micro-batches")
        batch = self.queue.pop(0)
        segments, real = batch.pop("segments"), batch.pop("segments_real", None)
        batch.pop("tokens_real")
        moved = {k: (v.to(self.device) if hasattr(v, "to") else v) for k, v in batch.items()}
        moved["packed_seq_params"] = packed_seq_params(segments, self.device, real)
        return moved


def text_sample(seq, loss_mask=None) -> dict:
    """The packer's sample of a token sequence of L + 1 tokens: L inputs, L labels, positions 0..L-1."""
    import torch

    length = seq.shape[-1] - 1
    mask = torch.ones(length, dtype=torch.float) if loss_mask is None else loss_mask
    return {"tokens": seq[:-1].contiguous(), "labels": seq[1:].contiguous(), "loss_mask": mask,
            "position_ids": torch.arange(length)}


def _document_problems(args, model: str) -> list[str]:
    flags = [flag for flag, dest in (("--reset-attention-mask", "reset_attention_mask"),
                                     ("--reset-position-ids", "reset_position_ids")) if getattr(args, dest, False)]
    if not flags:
        return []
    named = " and ".join(flags)
    if model != "gpt":
        verb = "fills" if len(flags) == 1 else "fill"
        return [f"{named} {verb} the GPT's mock data rows with documents: drop {named} for --model {model}"]
    if getattr(args, "packing", False):
        return [f"--packing and {named} both split rows into samples (packs of samples, or documents ended by EOD "
                "tokens): keep one"]
    if getattr(args, "mock_lengths", "full") != "full":
        return [f"{named} {'gives' if len(flags) == 1 else 'give'} every row documents of skewed lengths already: "
                "drop --mock-lengths"]
    return []


def problems(args) -> list[str]:
    """--packing's refusals, --mock-lengths' and the documents' (one line each), before any rank starts."""
    model = getattr(args, "model", "gpt")
    synthetic = model == "gpt" or (model.endswith("-tiny") and not getattr(args, "data_path", None))
    if not synthetic and getattr(args, "mock_lengths", "full") != "full":
        return [f"--mock-lengths shapes the generated samples (the GPT's, a NAME-tiny's without --data-path): drop it "
                f"for --model {model}" + (" with --data-path" if getattr(args, "data_path", None) else "")]
    found = _document_problems(args, model)
    if not getattr(args, "packing", False):
        return found
    if args.micro_batch_size != 1:
        found.append(f"--packing packs each micro-batch into one row of --seq-length tokens: give --micro-batch-size "
                     f"1, not {args.micro_batch_size} (a step still trains --global-batch-size samples)")
    if getattr(args, "num_layers_per_virtual_pipeline_stage", None):
        found.append("--packing gives each step as many micro-batches as it has packs, which the interleaved schedule "
                     "cannot take (a multiple of the pipeline size): drop --num-layers-per-virtual-pipeline-stage")
    if getattr(args, "attention_dropout", 0.0):
        found.append("--packing runs attention through mm_adaptor.ops.varlen_attention, which has no dropout: give "
                     "--attention-dropout 0")
    if getattr(args, "hybrid_layer_pattern", None) is not None:
        found.append("--packing reaches the attention layers only: it does not combine with --hybrid-layer-pattern")
    return found
