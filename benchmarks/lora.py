"""LoRA against full fine-tuning, side by side in one run, on the same model and data: Qwen2.5-VL built randomly
initialised from an HF config (Qwen2.5-VL-3B's shapes on a device, vlm_throughput's reduced model on the CPU), its
vision tower frozen, trained by `mm-adaptor train` on generated image data, packed, bf16 with the distributed
optimizer:

- full fine-tuning: the language model and the projector train;
- LoRA: adapters (rank --r, alpha 2r) on the language model's and projector's linear_qkv, linear_proj, linear_fc1,
  linear_fc2, everything else frozen.

Per run: the trainable share (the trainer's banner), the optimizer's bytes on the rank (the optimizer state its
checkpoint holds: fp32 main parameters and Adam's two moments, read from the save's metadata), the peak memory (the
device allocator's peak on CUDA/NPU, the process's peak resident set on the CPU), non-padding tokens/s over the
steps after the first, and the ratios of LoRA to full fine-tuning.

    python benchmarks/lora.py [--device cpu|cuda] [--seq N] [--samples N] [--steps N] [--llm-layers N] [--r R]
                              [--train-args='ARGS'] [--start spawn|fork]
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import tempfile

from _common import ITERATION_FIELD, device_name, package_version, run_cli
from vlm_packing import make_data
from vlm_throughput import CPU_MIX, MIX, model_config, run_arguments, sized

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
TRAINABLE = re.compile(r"trainable ([\d,]+) of ([\d,]+) parameters")


def optimizer_bytes(save: str) -> int:
    """The bytes of the optimizer state in the save's latest checkpoint (every tensor key under `optimizer.`), from
    its torch_dist metadata (what megatron's load_tensors_metadata reads, without importing megatron here)."""
    import math

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    iteration = open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip()
    stored = FileSystemReader(os.path.join(save, f"iter_{int(iteration):07d}")).read_metadata().state_dict_metadata
    return sum(math.prod(entry.size) * entry.properties.dtype.itemsize for key, entry in stored.items()
               if key.startswith("optimizer.") and isinstance(entry, TensorStorageMetadata))


def run(opts, folder: str, name: str, extra: list[str]) -> dict:
    save = os.path.join(folder, name)
    argv = ["--hf-config", opts.config, "--data-path", opts.data, "--seq-length", str(opts.seq),
            "--micro-batch-size", "1", "--global-batch-size", str(opts.samples), "--train-iters", str(opts.steps),
            "--seed", str(opts.seed), "--packing", "--freeze-vision", "--bf16", "--use-distributed-optimizer",
            "--nproc-per-node", "1", "--lr", "1e-4", "--calculate-per-token-loss", "--attention-dropout", "0",
            "--eval-iters", "0", "--save", save, "--save-interval", str(opts.steps), "--log-interval", "1",
            "--log-tps", *extra, *shlex.split(opts.train_args)]
    returncode, stdout, stderr = run_cli(["train", *argv], 3600, fork=opts.start == "fork")
    lines = [line for line in stdout.splitlines() if re.search(r" iteration +\d+/ *\d+ \|", line)]
    found = TRAINABLE.search(stdout)
    if returncode or len(lines) < 2 or not found:
        sys.exit(f"mm-adaptor train ({name}) failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")

    def values(field: str) -> list[float]:
        return [float(re.search(ITERATION_FIELD.format(re.escape(field)), line).group(1)) for line in lines]

    rates = values("tokens per second")[1:]
    trainable, total = (int(group.replace(",", "")) for group in found.groups())
    return {"trainable": trainable, "total": total, "optimizer_bytes": optimizer_bytes(save),
            "peak_bytes": values("peak memory (GiB, most loaded rank)")[-1] * 2**30,
            "tokens_per_second": sum(rates) / len(rates), "loss": values("lm loss")[-1]}


def main() -> None:
    parser = run_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--r", type=int, default=16, help="the adapters' rank (alpha 2r, MindSpeed-MM's advice)")
    opts = sized(parser.parse_args())
    hf = model_config(opts.device, opts.llm_layers)
    lora = ["--lora-target-modules", *TARGETS, "--lora-r", str(opts.r), "--lora-alpha", str(2 * opts.r)]
    with tempfile.TemporaryDirectory() as folder:
        opts.config = os.path.join(folder, "config.json")
        with open(opts.config, "w") as f:
            json.dump(hf, f)
        opts.data = make_data(folder, 4 * opts.samples, opts.seed, CPU_MIX if opts.device == "cpu" else MIX)
        rows = {"full fine-tuning": run(opts, folder, "full", []), f"LoRA r {opts.r}": run(opts, folder, "lora", lora)}
    print(f"# {device_name(opts.device)}, torch {package_version('torch')}, megatron-core "
          f"{package_version('megatron-core')}; Qwen2.5-VL ({'3B shapes' if opts.device != 'cpu' else 'reduced'}: "
          f"{hf['num_hidden_layers']} language layers, hidden {hf['hidden_size']}), random, vision tower frozen, bf16, "
          f"distributed optimizer, one rank; {opts.samples} samples per step, packs of {opts.seq}, {opts.steps} steps "
          "(the first left out of tokens/s)")
    print("| run | trainable | optimizer state | peak memory | non-padding tokens/s | last loss |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['trainable']:,} of {r['total']:,} ({100 * r['trainable'] / r['total']:.2f}%) | "
              f"{r['optimizer_bytes'] / 2**20:.1f} MiB | {r['peak_bytes'] / 2**30:.2f} GiB | "
              f"{r['tokens_per_second']:.0f} | {r['loss']:.4f} |")
    full, adapted = rows.values()
    print(f"| LoRA / full | {adapted['trainable'] / full['trainable']:.4f}x | "
          f"{adapted['optimizer_bytes'] / full['optimizer_bytes']:.4f}x | "
          f"{adapted['peak_bytes'] / full['peak_bytes']:.2f}x | "
          f"{adapted['tokens_per_second'] / full['tokens_per_second']:.2f}x | |")


if __name__ == "__main__":
    main()
