"""What the trainer adds to Megatron's iteration line, and the FLOPs it adds to Megatron's count.

Each training step the batches read are counted on the ranks that hold distinct samples (tensor-, context-parallel
rank 0 of the first pipeline stage): non-padding language tokens, samples, rows and, for a vision-language family,
its vision tower's FLOPs. At the step's end one all-reduce makes them global (StepTotals). From them:
- Megatron's num_floating_point_operations (hence --log-throughput's TFLOP/s) gains the vision tower's FLOPs;
- --log-throughput's line gains the MFU against the device's peak (mm_adaptor.devices.peak_flops), naming it;
- --log-tps adds MindSpeed-MM's tokens per sample, non-padding tokens per second and samples per second;
- every line gains the data wait: the time a step waited for its batches (reading them, or for the loader
  workers), the slowest rank's, per step since the last line;
- a line gains the samples that failed to load and were skipped so far (--skip-bad-samples), where there are any;
- every line gains the peak memory of the most loaded rank (the device allocator's peak; on the CPU, which has
  none, the rank process's peak resident set);
- a mixture-of-experts model adds each MoE layer's expert-load spread (coefficient of variation of the tokens
  each expert got over the logged steps) (mm_adaptor.train.expert_load)."""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field

ITERATION_LINE = re.compile(r" iteration +(\d+)/ *\d+ \| consumed samples:")
ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+) \|")
THROUGHPUT = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|")


@dataclass
class StepTotals:
    """Counted on this rank while the step reads its batches, made global at its end."""
    tokens: int = 0
    samples: int = 0
    rows: int = 0
    vision_flops: float = 0.0
    counted_tokens: bool = False  # the batches counted their non-padding tokens (else: rows x seq length)
    # since the last iteration line (Megatron logs every --log-interval steps)
    interval_tokens: int = 0
    interval_samples: int = 0
    interval_steps: int = 0
    peak_bytes: int = 0  # the largest of the ranks' peaks so far
    skipped_samples: int = 0  # samples that failed to load and were skipped, all ranks, so far
    data_seconds: float = 0.0  # this step's wait for its batches, this rank
    interval_data_seconds: float = 0.0  # the slowest rank's per step, summed since the last line
    last: dict = field(default_factory=dict)

    def reset_step(self) -> None:
        self.tokens = self.samples = self.rows = 0
        self.vision_flops = 0.0
        self.data_seconds = 0.0

    @contextlib.contextmanager
    def waiting_for_data(self):
        """Time the step spends waiting for its batches (reading, or for the loader workers)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.data_seconds += time.perf_counter() - start

    def count(self, batch: dict) -> None:
        """One micro-batch as the forward step reads it."""
        if not self._counts_here():
            return
        from mm_adaptor.train import flops

        rows = _rows(batch)
        self.rows += rows
        self.vision_flops += flops.vision_flops_of_batch(batch)

    @staticmethod
    def _counts_here() -> bool:
        from megatron.core import parallel_state as ps

        return (ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
                and ps.get_pipeline_model_parallel_rank() == 0)

    def finish_step(self, source, args, device) -> None:
        """All-reduce this step's counts (every rank calls it once per step)."""
        import torch
        import torch.distributed as dist

        here = self._counts_here()
        tokens = getattr(source, "tokens_this_step", None)
        self.counted_tokens = tokens is not None
        if tokens is None:
            tokens = self.rows * args.seq_length
        skipped = len(getattr(source, "failed", None) or ()) if here else 0
        local = torch.tensor([int(tokens) if here else 0, self.rows, skipped], dtype=torch.int64, device=device)
        dist.all_reduce(local)  # integers: exact, and every collective library sums int64
        vision = torch.tensor([self.vision_flops], dtype=torch.float32, device=device)
        dist.all_reduce(vision)
        from mm_adaptor.devices.memory import peak_bytes

        slowest = torch.tensor([peak_bytes(device), int(self.data_seconds * 1e6)], dtype=torch.int64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        self.peak_bytes = int(slowest[0])
        self.interval_data_seconds += int(slowest[1]) / 1e6
        self.tokens, self.rows, self.skipped_samples = int(local[0]), int(local[1]), int(local[2])
        self.samples = args.global_batch_size
        self.vision_flops = float(vision[0])
        self.interval_tokens += self.tokens
        self.interval_samples += self.samples
        self.interval_steps += 1

    def line_fields(self, line: str, args) -> str:
        """The fields to append to Megatron's iteration line `line`."""
        fields = []
        elapsed = ELAPSED.search(line)
        seconds = float(elapsed.group(1)) / 1000 if elapsed else None
        steps = max(1, self.interval_steps)
        if getattr(args, "log_tps", False) and seconds:
            tokens, samples = self.interval_tokens / steps, self.interval_samples / steps
            per_sample = tokens / samples if samples else 0.0
            what = "" if self.counted_tokens else " (padded)"
            fields += [f"tokens per sample: {per_sample:.1f}", f"tokens per second{what}: {tokens / seconds:.1f}",
                       f"samples per second: {samples / seconds:.2f}"]
            self.last.update(tokens_per_second=tokens / seconds, samples_per_second=samples / seconds)
        throughput = THROUGHPUT.search(line)
        if throughput:
            from mm_adaptor.devices import peak_flops

            peak = peak_flops.peak_for_run(args)
            if peak is None:
                fields.append(f"MFU: n/a ({peak_flops.no_peak_reason()})")
            else:
                mfu = float(throughput.group(1)) / peak.tflops
                fields.append(f"MFU: {100 * mfu:.1f}% of {peak.describe()}")
                self.last["mfu"] = mfu
        if self.interval_steps:
            wait = 1000 * self.interval_data_seconds / steps
            fields.append(f"data wait (ms, slowest rank): {wait:.1f}")
            self.last["data_wait_ms"] = wait
        if self.peak_bytes:
            fields.append(f"peak memory (GiB, most loaded rank): {self.peak_bytes / 2**30:.3f}")
            self.last["peak_bytes"] = self.peak_bytes
        if self.skipped_samples:
            fields.append(f"samples skipped (failed to load): {self.skipped_samples}")
        from mm_adaptor.train import expert_load

        spread = expert_load.LOADS.spread_field()
        if spread:
            fields.append(spread)
        self.interval_tokens = self.interval_samples = self.interval_steps = 0
        self.interval_data_seconds = 0.0
        return "".join(f" {f} |" for f in fields)


STEP = StepTotals()


def _rows(batch: dict) -> int:
    for name in ("tokens", "input_ids", "labels"):
        tensor = batch.get(name)
        if tensor is not None and hasattr(tensor, "shape"):
            return int(tensor.shape[0])
    return 0
