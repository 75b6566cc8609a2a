"""Qwen2.5-VL training batches from messages-format data: validation, token layout, DP sharding, collation.

Token layout of a sample (Qwen2.5-VL's chat template; Qwen3-VL's writes no system turn without a system message;
every `<image>` tag becomes <|vision_start|>, one <|image_pad|> per merged patch (t*h*w/4), <|vision_end|>):
  <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n
  <|im_start|>assistant\\n...<|im_end|>\\n   (further user/assistant turns alike)
Loss targets: each assistant reply and its <|im_end|>; the system, user turns, assistant headers and the newline
after <|im_end|> are masked.

A batch (dict) for micro_batch_size b and seq_length s, padded on the right with <|endoftext|>:
  input_ids [b, s] long; labels [b, s] long, already shifted: labels[:, t] = input_ids[:, t+1] where that token is
  a target, else -100 (and -100 at t = s-1); loss_mask [b, s] float, 1 where labels is a target (megatron's
  GPTModel takes the labels unshifted and returns the loss per token [b, s], so pass labels and multiply by
  loss_mask); attention_mask [b, s] bool, True on real tokens (right padding: the model can run causal attention
  with attention_mask=None, pad tokens follow every real token and carry no loss); position_ids [3, b, s] long
  (the config's family's rope_index_for with the attention mask; pad positions are 1); pixel_values [sum of
  patches, 3*2*P*P] float32 (1176 for Qwen2.5-VL's patch 14, 1536 for Qwen3-VL's 16) and image_grid_thw
  [images, 3] long, both None when no sample of the batch has an image; num_tokens [b] long, the real tokens per
  sample (for throughput); sample_index [b] long, the dataset index of each sample.

Image preprocessing: `processing` (data.images.ImageProcessing; for a checkpoint ImageProcessing.for_directory)
wherever it is taken; None is Qwen2.5-VL's. image_min_pixels/image_max_pixels, where given, replace its bounds.

Sharding: the samples of iteration i are positions i*G .. i*G+G-1 of an endless stream, epoch e being a permutation
of the good samples seeded by (seed, e); DP rank r takes the contiguous slice r*G/D .. (r+1)*G/D of each global
batch, in micro-batches of b. The global batch is the same at any DP size; start_iteration resumes the stream."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from mm_adaptor.data import images as image_ops
from mm_adaptor.data.packing import VISUAL_FIELDS
from mm_adaptor.data.records import DataError, Sample  # noqa: F401 (Sample: re-exported)
from mm_adaptor.data.template import DEFAULT_SYSTEM, encode  # noqa: F401 (re-exported)

IGNORE_INDEX = -100
DEFAULT_BAD_LIMIT = 100  # --skip-bad-samples without N: samples that may fail to load while training
# what loading a validated sample raises when its files changed since: PIL's errors are OSError, SyntaxError or
# ValueError kinds (and DecompressionBombError, an Exception)
LOAD_ERRORS = (OSError, ValueError, SyntaxError, DataError)


@dataclass
class Report:
    """The validation pass: the good samples, and one line per bad record (file and record or line number)."""
    samples: list = field(default_factory=list)
    bad: list = field(default_factory=list)

    @property
    def skipped(self) -> int:
        return len(self.bad)

    def summary(self) -> str:
        return f"{len(self.samples)} samples, {self.skipped} bad ones skipped"


def validate(data_path, tokenizer, seq_length: int, image_min_pixels: int | None = None,
             image_max_pixels: int | None = None, max_samples: int | None = None,
             skip_bad_samples: bool = False, processing=None, cache_dir=None, workers: int | None = None,
             verbose: bool = False) -> Report:
    """The validation pass, through the data's index (data.index: built once per data and settings, in a process
    pool; opened memory-mapped after): every record read, every image opened (header and checksum, no decoding of
    pixels into tensors), its tokens counted. Bad records: malformed JSON, missing keys, an image missing or
    unreadable, images != <image> tags, longer than seq_length. Without skip_bad_samples any bad record raises
    DataError naming them all."""
    from mm_adaptor.data.index import open_or_build

    processing = _processing(processing, image_min_pixels, image_max_pixels)
    index = open_or_build(data_path, tokenizer, seq_length, processing, max_samples, cache_dir, workers, verbose)
    report = Report(index.samples(), index.bad_lines())
    if report.bad and not skip_bad_samples:
        shown = "; ".join(report.bad[:5]) + ("; ..." if len(report.bad) > 5 else "")
        raise DataError(f"{len(report.bad)} bad samples (--skip-bad-samples trains on the rest): {shown}")
    return report


class Loaded(NamedTuple):
    """One sample loaded: token ids, is-target flags, its images' pixel_values [patches, 3*2*P*P] and grids, its
    videos' pixel_values_videos and grids and (Qwen2.5-VL) seconds per temporal patch; pixels None without any."""
    ids: list
    flags: list
    pixels: torch.Tensor | None
    grids: list
    video_pixels: torch.Tensor | None = None
    video_grids: list = []
    seconds: list = []


def load_sample(sample: Sample, tokenizer, image_min_pixels, image_max_pixels, processing=None,
                decode_pixels: bool = True) -> Loaded:
    """One validated sample loaded; without decode_pixels no image or video is opened (pixels None; the grids come
    from the index)."""
    from PIL import Image

    processing = _processing(processing, image_min_pixels, image_max_pixels)
    ids, flags = encode(sample.record, sample.grids, tokenizer, processing, sample.clips)
    pixels = []
    for path, grid in zip(sample.record.images if decode_pixels else [], sample.grids):
        with Image.open(path) as image:
            values, got = processing.preprocess(image)
        if tuple(got) != tuple(grid):
            raise DataError(f"{path}: changed since validation (grid {got}, was {grid})")
        pixels.append(torch.from_numpy(values))
    video = getattr(processing, "video", None)  # (a record with videos was refused by validation without one)
    video_grids = [video.grid(clip) for clip in sample.clips]
    frames = [torch.from_numpy(video.pixels(path, clip)[0])
              for path, clip in zip(sample.record.videos if decode_pixels else [], sample.clips)]
    seconds = [video.seconds_per_grid(clip) for clip in sample.clips] if video_grids and video.family == "qwen2_5_vl" \
        else []
    return Loaded(ids, flags, torch.cat(pixels) if pixels else None, sample.grids,
                  torch.cat(frames) if frames else None, video_grids, seconds)


def collate(loaded, seq_length: int, pad_id: int, config, sample_index=None) -> dict:
    """The batch dict (see the module docstring) of load_sample results."""
    from mm_adaptor.models import rope_index_for

    b = len(loaded)
    input_ids = torch.full((b, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((b, seq_length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((b, seq_length), dtype=torch.bool)
    for row, (ids, flags, *_) in enumerate(loaded):
        n = len(ids)
        input_ids[row, :n] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, :n] = True
        next_is_target = torch.tensor(flags[1:], dtype=torch.bool)
        labels[row, :n - 1] = torch.where(next_is_target, input_ids[row, 1:n], IGNORE_INDEX)
    loss_mask = (labels != IGNORE_INDEX).float()
    visual = visual_fields(loaded)
    position_ids, _ = rope_index_for(config, input_ids, attention_mask=attention_mask.long(), **positions_of(visual))
    return {
        "input_ids": input_ids, "labels": labels, "loss_mask": loss_mask, "attention_mask": attention_mask,
        "position_ids": position_ids.long(), **{name: visual[name] for name in VISUAL_FIELDS},
        "num_tokens": attention_mask.sum(1),
        "sample_index": torch.tensor(sample_index if sample_index is not None else [-1] * b, dtype=torch.long),
    }


def visual_fields(loaded) -> dict:
    """The model's visual inputs of Loaded samples (VISUAL_FIELDS, each None without any) and the videos'
    second_per_grid_ts (None without one, or for a family whose positions take none)."""
    def joined(name):
        parts = [getattr(one, name) for one in loaded if getattr(one, name) is not None]
        return torch.cat(parts) if parts else None

    def grid(name):
        rows = [list(g) for one in loaded for g in getattr(one, name)]
        return torch.tensor(rows, dtype=torch.long) if rows else None

    seconds = [s for one in loaded for s in one.seconds]
    return {"pixel_values": joined("pixels"), "image_grid_thw": grid("grids"),
            "pixel_values_videos": joined("video_pixels"), "video_grid_thw": grid("video_grids"),
            "second_per_grid_ts": seconds or None}


def positions_of(visual: dict) -> dict:
    """The rope index's keyword arguments of visual_fields."""
    found = {"image_grid_thw": visual["image_grid_thw"], "video_grid_thw": visual["video_grid_thw"]}
    if visual["second_per_grid_ts"] is not None:
        found["second_per_grid_ts"] = visual["second_per_grid_ts"]
    return found


def global_batch_indices(iteration: int, global_batch_size: int, num_samples: int, seed: int) -> list[int]:
    """Dataset indices of iteration's global batch: positions of an endless stream of seeded per-epoch
    permutations (independent of the DP size)."""
    first = iteration * global_batch_size
    return [stream_index(range(num_samples), p, seed) for p in range(first, first + global_batch_size)]


def stream_index(samples, position: int, seed: int) -> int:
    """The sample at a position of the stream over `samples`: a blend's (data.blend), else epoch e's seeded
    permutation (e = position // len(samples))."""
    if hasattr(samples, "stream_index"):
        return samples.stream_index(position, seed)
    epoch, offset = divmod(position, len(samples))
    return int(_permutation(len(samples), seed, epoch)[offset])


@functools.lru_cache(maxsize=8)
def _permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


class BatchIterator:
    """Endless micro-batches of this DP rank, iteration by iteration from start_iteration; num_microbatches of
    them make one iteration. `report` is the validation pass (report.skipped: bad samples skipped)."""

    def __init__(self, report, tokenizer, config, seq_length, micro_batch_size, global_batch_size, dp_rank,
                 dp_size, start_iteration, image_min_pixels, image_max_pixels, seed, processing=None, bad_limit=0,
                 decode_pixels=True):
        if global_batch_size % (micro_batch_size * dp_size):
            raise DataError(f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size "
                            f"{micro_batch_size} x data-parallel size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        self.report, self.tokenizer, self.config = report, tokenizer, config
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        self.global_batch_size, self.dp_rank, self.dp_size = global_batch_size, dp_rank, dp_size
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)
        self.pixels = (image_min_pixels, image_max_pixels)
        self.processing = processing
        self.seed, self.iteration, self._micro = seed, start_iteration, 0
        self.start_iteration = start_iteration
        self.pad_id = tokenizer.special_ids["<|endoftext|>"]
        self.bad_limit, self.failed = int(bad_limit), []
        self.decode_pixels = decode_pixels  # False: a rank whose model part takes no pixels (pipeline stages > 0)

    def load(self, index: int):
        """(load_sample of sample `index`, the index loaded). One that fails to load (its image gone, changed or
        unreadable, its record changed) is skipped for the next sample that loads, said in one line (printed: a
        warning may be filtered) and kept in `failed`, up to bad_limit: past it, DataError naming every one."""
        samples = self.report.samples
        for _ in range(len(samples)):
            try:
                return load_sample(samples[index], self.tokenizer, *self.pixels, self.processing,
                                   self.decode_pixels), index
            except LOAD_ERRORS as exc:
                self.failed.append(_failure(samples, index, exc))
            if len(self.failed) > self.bad_limit:
                shown = "; ".join(self.failed[:10]) + ("; ..." if len(self.failed) > 10 else "")
                if self.bad_limit:
                    raise DataError(f"{len(self.failed)} samples failed to load while training, more than "
                                    f"--skip-bad-samples {self.bad_limit}: {shown}")
                raise DataError(f"a sample failed to load while training: {shown} (--skip-bad-samples N skips up to "
                                "N of them)")
            if torch.utils.data.get_worker_info() is None:  # a loader worker's rank says it (loader.WorkerBatches)
                print(skipped_line(self.failed[-1], len(self.failed), self.bad_limit), flush=True)
            index = (index + 1) % len(samples)
        raise DataError("no sample of the data loads")

    def seek(self, position: int) -> None:
        """Next: this rank's `position`-th micro-batch from start_iteration on."""
        self.iteration, self._micro = divmod(position, self.num_microbatches)
        self.iteration += self.start_iteration

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        first = self.step_positions(self.iteration)[self._micro * self.micro_batch_size]
        chosen = [stream_index(self.report.samples, p, self.seed) for p in range(first, first + self.micro_batch_size)]
        self._micro += 1
        if self._micro == self.num_microbatches:
            self.iteration, self._micro = self.iteration + 1, 0
        loaded, chosen = zip(*(self.load(i) for i in chosen))  # a sample that failed to load: its substitute
        return collate(list(loaded), self.seq_length, self.pad_id, self.config, list(chosen))

    def step_positions(self, iteration: int) -> list[int]:
        """Stream positions this DP rank reads in `iteration` (what __next__ reads, in order)."""
        per_rank = self.global_batch_size // self.dp_size
        first = iteration * self.global_batch_size + self.dp_rank * per_rank
        return list(range(first, first + per_rank))

    def packed_sample(self, position: int) -> dict:
        """The sample at a stream position as the packer takes it (data.packing.pack): its own tokens, labels where
        the next token is a target, its 3-D rope index from 0, its pixels and grids."""
        from mm_adaptor.models import sample_positions

        index = stream_index(self.report.samples, position, self.seed)
        loaded, _ = self.load(index)
        tokens = torch.tensor(loaded.ids, dtype=torch.long)
        labels = torch.full_like(tokens, IGNORE_INDEX)
        labels[:-1] = torch.where(torch.tensor(loaded.flags[1:], dtype=torch.bool), tokens[1:], IGNORE_INDEX)
        visual = visual_fields([loaded])
        return {"tokens": tokens, "labels": labels, "loss_mask": (labels != IGNORE_INDEX).float(),
                "position_ids": sample_positions(self.config, tokens, **positions_of(visual)),
                **{name: visual[name] for name in VISUAL_FIELDS}}


def build(data_path, tokenizer, config, seq_length: int, micro_batch_size: int = 1, global_batch_size: int = 1,
          dp_rank: int = 0, dp_size: int = 1, start_iteration: int = 0,
          image_min_pixels: int | None = None, image_max_pixels: int | None = None,
          skip_bad_samples: bool = False, max_samples: int | None = None, seed: int = 1234,
          report: Report | None = None, processing=None, cache_dir=None,
          decode_pixels: bool = True) -> BatchIterator:
    """Validate the data (DataError on bad records unless skip_bad_samples) and return this rank's BatchIterator.
    config: the model's config (its token ids must be the tokenizer's: check_model_matches); processing: its
    image preprocessing (None: Qwen2.5-VL's). skip_bad_samples: True, or how many samples may fail to load while
    training (True: DEFAULT_BAD_LIMIT)."""
    from mm_adaptor.data.tokenizer import check_model_matches

    check_model_matches(tokenizer, config)
    image_min_pixels, image_max_pixels = _pixel_bounds(image_min_pixels, image_max_pixels, processing)
    if report is None:  # else the launching process's validation pass of the same data and settings
        report = validate(data_path, tokenizer, seq_length, image_min_pixels, image_max_pixels, max_samples,
                          bool(skip_bad_samples), processing, cache_dir)
    if not report.samples:
        raise DataError(f"no usable samples in {data_path} ({report.skipped} bad ones skipped)")
    return BatchIterator(report, tokenizer, config, seq_length, micro_batch_size, global_batch_size, dp_rank,
                         dp_size, start_iteration, image_min_pixels, image_max_pixels, seed, processing,
                         bad_limit(skip_bad_samples), decode_pixels)


def skipped_line(failure: str, count: int, limit: int) -> str:
    return f"data: skipped {failure} ({count} of at most {limit})"


def bad_limit(skip_bad_samples) -> int:
    """How many samples may fail to load while training: --skip-bad-samples' N, DEFAULT_BAD_LIMIT without one."""
    if skip_bad_samples is True:
        return DEFAULT_BAD_LIMIT
    return int(skip_bad_samples or 0)


def _failure(samples, index: int, exc: Exception) -> str:
    """One line: the record that failed to load and why."""
    try:
        record = samples[index].record
        where = f"{record.file} {record.where}"
    except LOAD_ERRORS:  # the record itself changed: its error names it
        where = f"sample {index}"
    return " ".join(f"{where}: {type(exc).__name__}: {exc}".split())


def _pixel_bounds(low, high, processing=None):
    # None: the processing's bounds (Qwen2.5-VL's defaults without one)
    processing = processing or image_ops.QWEN2_5_VL
    low = processing.min_pixels if low is None else int(low)
    high = processing.max_pixels if high is None else int(high)
    if not 0 < low <= high:
        raise DataError(f"image_min_pixels {low} and image_max_pixels {high}: want 0 < min <= max")
    return low, high


def _processing(processing, low, high):
    # the processing with the checked pixel bounds (given ones win)
    processing = processing or image_ops.QWEN2_5_VL
    return processing.with_pixels(*_pixel_bounds(low, high, processing))
