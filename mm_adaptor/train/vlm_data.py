"""Batches for the driver's VLM branch: a data set through mm_adaptor.data, or synthetic image + text samples
(NAME-tiny without --data-path). Either way sample g depends only on (seed, g), so every layout sees the
same global batch, and a resumed run continues where it stopped."""

from __future__ import annotations

from mm_adaptor.train import preprocessing


class _Batches:
    """Iterates micro-batches of this data-parallel rank from `sample_batch(global indices)`."""

    def __init__(self, args, config, dp_rank: int, start_iteration: int, device):
        self.args, self.config, self.dp_rank, self.device = args, config, dp_rank, device
        self.iteration, self.microbatch = start_iteration, 0
        self.start_iteration = start_iteration
        self.tokens_this_step = 0  # non-padding language tokens this rank read in the current step

    def seek(self, position: int) -> None:
        """Next: this rank's `position`-th micro-batch from the start (a data loader worker's share)."""
        self.iteration, self.microbatch = divmod(position, self.args.num_microbatches)
        self.iteration += self.start_iteration

    def __iter__(self):
        return self

    def start_step(self) -> None:
        self.tokens_this_step = 0

    def __next__(self):
        a = self.args
        base = (self.iteration * a.global_batch_size + self.microbatch * a.micro_batch_size * a.data_parallel_size
                + self.dp_rank * a.micro_batch_size)
        batch = self.sample_batch(list(range(base, base + a.micro_batch_size)))
        self.microbatch += 1
        if self.microbatch == a.num_microbatches:
            self.microbatch, self.iteration = 0, self.iteration + 1
        self.tokens_this_step += int(batch.pop("tokens"))
        return {k: (v.to(self.device) if hasattr(v, "to") else v) for k, v in batch.items()}


class SyntheticBatches(_Batches):
    """Each sample: <vision_start> 4 image tokens (a 8x8-patch image, 16 patches) <vision_end>, then an arithmetic
    progression over the first 32 token ids whose start and stride come from the sample. Loss on the text only.
    With --mock-lengths skewed the text is shorter (train.data.sample_length; padded, its loss masked); --packing
    packs `packed_sample`s instead."""

    GRID = (1, 4, 4)
    ALPHABET = 32

    def sample(self, index: int):
        """(seq [--seq-length + 1], pixels, loss mask [--seq-length], real tokens): padded after a shorter sample."""
        import torch

        seq, pixels, mask = self.unpadded(index)
        length = self.args.seq_length
        padded, padded_mask = torch.zeros(length + 1, dtype=seq.dtype), torch.zeros(length)
        padded[:seq.numel()], padded_mask[:mask.numel()] = seq, mask
        return padded, pixels, padded_mask, seq.numel() - 1

    def packed_sample(self, index: int) -> dict:
        """Sample `index` as the packer takes it (data.packing.pack): its own tokens, 3-D positions from 0."""
        import torch

        from mm_adaptor.data.packing import text_sample
        from mm_adaptor.models import family_package, sample_positions

        seq, pixels, mask = self.unpadded(index)
        sample = text_sample(seq, mask)
        grid = None if hasattr(family_package(self.config), "synthetic_visual") else torch.tensor([self.GRID])
        sample["position_ids"] = sample_positions(self.config, sample["tokens"], grid)
        return {**sample, "pixel_values": pixels, "image_grid_thw": grid}

    def unpadded(self, index: int):
        import torch

        from mm_adaptor.models import family_package
        from mm_adaptor.train.data import sample_length

        c, length = self.config, self.args.seq_length
        gen = torch.Generator().manual_seed(self.args.seed * 1_000_003 + index)
        visual = getattr(family_package(c), "synthetic_visual", None)  # a family without image grids (InternVL)
        if visual is not None:
            prompt, pixels = visual(c, gen)
        else:
            patches = self.GRID[0] * self.GRID[1] * self.GRID[2]
            pixels = torch.randn(patches, c.patch_dim, generator=gen)
            merged = patches // c.spatial_merge_size**2
            prompt = [c.vision_start_token_id] + [c.image_token_id] * merged + [c.vision_start_token_id + 1]
        start = int(torch.randint(0, self.ALPHABET, (1,), generator=gen))
        stride = int(torch.randint(1, 8, (1,), generator=gen))
        length = sample_length(self.args, gen, shortest=len(prompt) + 1)  # drawn last: full-length samples as before
        text = ((start + stride * torch.arange(length + 1 - len(prompt))) % self.ALPHABET).tolist()
        seq = torch.tensor(prompt + text)
        mask = torch.zeros(length)
        mask[len(prompt) - 1:] = 1.0  # labels from the first text token on
        return seq, pixels, mask

    def sample_batch(self, indices):
        import torch

        from mm_adaptor.models import family_package, rope_index_for

        seqs, pixels, masks, real = zip(*(self.sample(i) for i in indices))
        seqs = torch.stack(seqs)
        input_ids = seqs[:, :-1].contiguous()
        grid = None if hasattr(family_package(self.config), "synthetic_visual") else \
            torch.tensor([self.GRID] * len(indices))
        positions, _ = rope_index_for(self.config, input_ids, grid)
        return {"input_ids": input_ids, "labels": seqs[:, 1:].contiguous(), "loss_mask": torch.stack(masks),
                "position_ids": positions, "pixel_values": torch.cat(pixels), "image_grid_thw": grid,
                "tokens": sum(real)}


class DatasetBatches:
    """This DP rank's micro-batches of --data-path through mm_adaptor.data (which shards DP-independently and
    resumes at start_iteration); counts the non-padding tokens it hands out."""

    def __init__(self, args, config, dp_rank, start_iteration, device):
        from mm_adaptor.data import build

        self.device, self.tokens_this_step = device, 0
        split = getattr(args, "data_split", "train")
        self.batches = build(records_path(args, split), tokenizer(args, config), config, args.seq_length,
                             args.micro_batch_size, args.global_batch_size, dp_rank, args.data_parallel_size,
                             start_iteration, skip_bad_samples=args.skip_bad_samples, seed=args.seed,
                             report=_validated(args, split), processing=preprocessing.processing(args, config),
                             decode_pixels=getattr(args, "decode_pixels", True))

    def __iter__(self):
        return self

    def start_step(self) -> None:
        self.tokens_this_step = 0

    def seek(self, position: int) -> None:
        self.batches.seek(position)

    def packed_sample(self, position: int) -> dict:
        return self.batches.packed_sample(position)

    def step_positions(self, iteration: int) -> list[int]:
        return self.batches.step_positions(iteration)

    @property
    def failed(self) -> list[str]:
        """The samples that failed to load while training and were skipped (so far, here), one line each."""
        return self.batches.failed

    @property
    def bad_limit(self) -> int:
        return self.batches.bad_limit

    def __next__(self):
        batch = next(self.batches)
        self.tokens_this_step += int(batch["num_tokens"].sum())
        from mm_adaptor.data.packing import VISUAL_FIELDS

        return {k: batch[k].to(self.device) if batch[k] is not None else None
                for k in ("input_ids", "labels", "loss_mask", "position_ids", *VISUAL_FIELDS)}


def records_path(args, split: str = "train") -> str | None:
    """The records file of a split: --data-path (the runner's one file; Megatron's list of one, split by --split),
    or Megatron's --train-data-path / --valid-data-path / --test-data-path."""
    if isinstance(args.data_path, str):
        return args.data_path
    separate = getattr(args, f"{split}_data_path", None)
    if separate:
        return separate[0]
    return " ".join(args.data_path) if args.data_path else None  # a blend (blend_of): its whole list


def has_records(args) -> bool:
    """Whether the split being built (args.data_split) has samples: synthetic data always does; records do unless
    --split gives the split none, or Megatron's per-split paths name no file for it."""
    split = getattr(args, "data_split", "train")
    if not records_path(args, "train"):
        return True
    report = _validated(args, split)
    if report is not None:
        return bool(report.samples)
    return records_path(args, split) is not None


def record_split_problems(args) -> list[str]:
    """What the trainer cannot read of Megatron's data arguments for records (one line each): a blend is read
    from --data-path (with --split), not from the per-split paths."""
    for split in ("train", "valid", "test"):
        paths = getattr(args, f"{split}_data_path", None)
        if isinstance(paths, list) and len(paths) > 1:
            return [f"--{split}-data-path {' '.join(paths)}: a blend of vision-language records is read from "
                    "--data-path W1 P1 W2 P2 ... with --split; give one file here"]
    return []


def blend_of(args):
    """[(weight or None, path)] of a --data-path blend (several files), else None."""
    from mm_adaptor.data.blend import parse_blend

    if isinstance(args.data_path, list) and len(args.data_path) > 1:
        return parse_blend(args.data_path)
    return None


def split_fractions(args) -> tuple[float, float, float] | None:
    """Megatron's --split of one --data-path file (train, valid, test fractions), None when each split has its
    own file."""
    if isinstance(args.data_path, str) or not args.data_path:
        return None
    parts = [float(x) for x in str(args.split or "969, 30, 1").replace("/", ",").split(",") if x.strip()]
    parts += [0.0] * (3 - len(parts))
    total = sum(parts[:3])
    return tuple(part / total for part in parts[:3])


def _split_report(report, fractions, split: str):
    """The split's part of the records, in the order of the file (Megatron's --split over document order)."""
    from dataclasses import replace

    if fractions is None:
        return report
    count = len(report.samples)
    bounds = [0, round(fractions[0] * count), round((fractions[0] + fractions[1]) * count), count]
    index = ("train", "valid", "test").index(split)
    return replace(report, samples=report.samples[bounds[index]:bounds[index + 1]])


def fingerprint(reports) -> str | None:
    """The data's identity per split (each index's key: the files' content and the settings), or None for
    synthetic data."""
    if reports is None:
        return None
    reports = reports if isinstance(reports, dict) else {"train": reports}
    keys = [f"{split}:{report.samples.key}" for split, report in sorted(reports.items())
            if hasattr(report.samples, "key")]
    return " ".join(keys) or None


# The trainer's ranks: the launching process's validation pass, per split (receive); kept off Megatron's
# arguments, which its checkpoints pickle.
RECEIVED: dict = {}


def receive(reports: dict) -> None:
    RECEIVED.clear()
    RECEIVED.update(reports)


def _validated(args, split: str):
    reports = getattr(args, "validated_data", None) or RECEIVED or None  # the runner's, or the trainer's
    return reports.get(split) if isinstance(reports, dict) else reports


def tokenizer(args, config):
    """--tokenizer-model, else --load's hf/ where it holds one, else the byte tokenizer for a tiny model."""
    from mm_adaptor.data.tokenizer import for_checkpoint

    from mm_adaptor.train.families import model_home

    return for_checkpoint(args.tokenizer_model, model_home(args), config)


def validate(args, config) -> list[str]:
    """The data set's validation pass (images opened, tokens counted) and the tokenizer/`config` match: the
    DataError's line, or nothing. The pass's report goes to args.validated_data, which the ranks this process
    launches receive with their arguments: they build their batches from it without a second pass. The byte
    tokenizer is said, in one line."""
    from mm_adaptor.data import DataError
    from mm_adaptor.data.tokenizer import BYTE_TOKENIZER_NOTE, ByteTokenizer

    try:
        tok = tokenizer(args, config)
    except DataError as exc:
        return [str(exc)]
    if isinstance(tok, ByteTokenizer) and _says():
        print(f"data: {BYTE_TOKENIZER_NOTE}", flush=True)
    if isinstance(args.data_path, str):  # the runner's one file
        try:
            report = _validated_file(args, config, args.data_path, tok)
        except (DataError, ValueError) as exc:
            return [f"--data-path {args.data_path}: {exc}"]
        args.validated_data = report
        return []
    problems = record_split_problems(args)
    if problems:
        return problems
    try:
        blend = blend_of(args)
        if blend:
            args.validated_data = _blended_reports(args, config, tok, blend)
            return []
    except (DataError, ValueError) as exc:
        return [f"--data-path {' '.join(args.data_path)}: {exc}"]
    fractions, reports, files = split_fractions(args), {}, {}
    for split in ("train", "valid", "test"):
        path = records_path(args, split)
        if path is None:
            continue
        try:
            if path not in files:
                files[path] = _validated_file(args, config, path, tok)
        except (DataError, ValueError) as exc:
            flag = "--data-path" if fractions else f"--{split}-data-path"
            return [f"{flag} {path}: {exc}"]
        reports[split] = _split_report(files[path], fractions, split)
    if fractions and not reports["train"].samples:
        return [f"--split {args.split} leaves no training records of {len(files[records_path(args)].samples)}: "
                "give the training split a larger share"]
    args.validated_data = reports
    return []


def _blended_reports(args, config, tok, blend) -> dict:
    """Each split's Report over the blend: every data set validated, split by --split, blended by its weight (by
    its split's size where --data-path gives no weights)."""
    from mm_adaptor.data import DataError
    from mm_adaptor.data.blend import BlendedSamples
    from mm_adaptor.data.vlm import Report

    fractions = split_fractions(args)
    whole = [_validated_file(args, config, path, tok) for _, path in blend]
    weights = None if blend[0][0] is None else [weight for weight, _ in blend]
    reports = {}
    for split in ("train", "valid", "test"):
        parts = [_split_report(report, fractions, split) for report in whole]
        bad = [line for report in (whole if split == "train" else []) for line in report.bad]
        if not any(len(part.samples) for part in parts):
            if split == "train":
                raise DataError(f"--split {args.split} leaves no training records")
            reports[split] = Report([], bad)
            continue
        reports[split] = Report(BlendedSamples([part.samples for part in parts], weights), bad)
    return reports


def _validated_file(args, config, path, tok):
    from mm_adaptor.data import DataError, check_model_matches
    from mm_adaptor.data import validate as validate_data

    check_model_matches(tok, config)
    report = validate_data(path, tok, args.seq_length, skip_bad_samples=args.skip_bad_samples,
                           processing=preprocessing.processing(args, config),
                           cache_dir=getattr(args, "data_cache", None))
    if not report.samples:
        raise DataError(f"no usable samples ({report.skipped} bad ones skipped)")
    if report.skipped and _says():
        print(f"data: {path}: {report.summary()} (--skip-bad-samples; one line each in "
              f"{report.samples.index.directory / 'bad.txt'})", flush=True)
    return report


def _says() -> bool:
    """This process speaks for the run: the launching process, or torchrun's rank 0."""
    import os

    return os.environ.get("RANK", "0") == "0"
