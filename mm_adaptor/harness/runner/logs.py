"""The driver's output: Megatron-style iteration lines, the layout in one word, and the closing summary."""

from __future__ import annotations

import time
from dataclasses import dataclass

_silent = False


def set_silent(silent: bool) -> None:
    global _silent
    _silent = silent


def print_last_rank(msg: str) -> None:
    import torch.distributed as dist

    if not _silent and dist.get_rank() == dist.get_world_size() - 1:
        print(msg, flush=True)


@dataclass
class StepRecord:
    iteration: int
    loss: float | None
    grad_norm: float | None
    elapsed_ms: float
    lr: float
    tokens_per_second: float
    tokens_per_sample: float | None = None  # --log-tps: non-padding language tokens per sample
    samples_per_second: float | None = None


def format_iteration(args, rec: StepRecord, consumed: int, loss_scale: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        f" [{stamp}] iteration {rec.iteration:8d}/{args.train_iters:8d}",
        f"consumed samples: {consumed:12d}",
        f"elapsed time per iteration (ms): {rec.elapsed_ms:.1f}",
        f"learning rate: {rec.lr:.6E}",
        f"global batch size: {args.global_batch_size:5d}",
        f"lm loss: {rec.loss:.6E}",
        f"loss scale: {loss_scale:.1f}",
    ]
    if rec.grad_norm is not None:
        parts.append(f"grad norm: {rec.grad_norm:.3f}")
    if getattr(args, "log_tps", False):  # MindSpeed-MM's --log-tps: non-padding language tokens
        parts.append(f"tokens per sample: {rec.tokens_per_sample:.1f}")
        parts.append(f"tokens per second: {rec.tokens_per_second:.1f}")
        parts.append(f"samples per second: {rec.samples_per_second:.2f}")
    else:
        parts.append(f"tokens per second: {rec.tokens_per_second:.1f}")
    return " | ".join(parts) + " |"


def describe_layout(args) -> str:
    parts = [f"TP{args.tensor_model_parallel_size}", f"PP{args.pipeline_model_parallel_size}"]
    if args.virtual_pipeline_model_parallel_size:
        parts.append(f"VPP{args.virtual_pipeline_model_parallel_size}")
    if getattr(args, "context_parallel_size", 1) > 1:
        parts.append(f"CP{args.context_parallel_size}({args.context_parallel_algo})")
    parts.append(f"DP{args.data_parallel_size}")
    if args.num_experts:
        parts.append(f"EP{args.expert_model_parallel_size}({args.num_experts} experts)")
    if args.sequence_parallel:
        parts.append("SP")
    if args.use_distributed_optimizer:
        parts.append("dist-opt")
    parts.append("bf16" if args.bf16 else "fp16" if args.fp16 else "fp32")
    return "+".join(parts)


def summary(args, records: list[StepRecord], start_iteration: int, layout: str) -> str:
    if not records:
        return f" training summary: nothing to do (already at iteration {start_iteration} of {args.train_iters})"
    steady = records[1:] or records
    mean_ms = sum(r.elapsed_ms for r in steady) / len(steady)
    tps = sum(r.tokens_per_second for r in steady) / len(steady)
    line = (f" training summary: {layout} | iterations {start_iteration + 1}-{records[-1].iteration} | "
            f"lm loss {records[0].loss:.4f} -> {records[-1].loss:.4f} | "
            f"mean iteration {mean_ms:.1f} ms (excluding the first) | tokens per second {tps:.1f}")
    if getattr(args, "log_tps", False):
        per_sample = sum(r.tokens_per_sample for r in steady) / len(steady)
        sps = sum(r.samples_per_second for r in steady) / len(steady)
        line += f" (non-padding) | tokens per sample {per_sample:.1f} | samples per second {sps:.2f}"
    return line
