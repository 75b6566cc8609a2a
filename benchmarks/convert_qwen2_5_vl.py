"""Converter benchmark: a randomly initialised Qwen2.5-VL-3B checkpoint (the real config's shapes, bf16, sharded
safetensors) converted HF -> Megatron -> HF by the `mm-adaptor convert` command, each direction in a process of
its own; prints seconds and peak resident memory (the process and its children) against the largest input shard,
then checks every tensor of the round trip is equal.

    python benchmarks/convert_qwen2_5_vl.py --work /tmp/convert_bench [--shard-gb 2] [--llm-layers 36]

Peak RSS is VmHWM of the converting process. Needs about 3 x 7.5 GB of disk under --work (the script checks before
writing)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

VISION = {"depth": 32, "hidden_size": 1280, "hidden_act": "silu", "intermediate_size": 3420, "num_heads": 16,
          "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
          "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "out_hidden_size": 2048}
CONFIG_3B = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
             "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
             "num_attention_heads": 16, "num_key_value_heads": 2, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
             "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
             "max_position_embeddings": 128000, "hidden_act": "silu",
             "torch_dtype": "bfloat16", "vision_config": VISION}

MEASURE = """import resource, sys, time
from mm_adaptor.cli import main
start = time.time()
rc = main(sys.argv[1:])
# VmHWM, not ru_maxrss: ru_maxrss keeps the benchmark parent's peak across fork and exec
hwm_kb = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
print("MEASURE", rc, time.time() - start, hwm_kb, flush=True)
sys.exit(rc)
"""


def write_random_checkpoint(path: Path, config: dict, shard_bytes: int) -> list[int]:
    """The HF names and shapes of the config (from transformers on the meta device), random bf16, one shard in
    memory at a time; returns the shards' sizes."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig.from_dict(config))
    names = {"model.language_model.": "model.", "model.visual.": "visual."}
    shapes = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue
        for new, old in names.items():
            name = name.replace(new, old) if name.startswith(new) else name
        shapes[name] = tuple(tensor.shape)
    groups, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = 2 * torch.Size(shape).numel()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    path.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    weight_map, sizes = {}, []
    for k, group in enumerate(groups, 1):
        file = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: (torch.randn(shapes[name], generator=generator) * 0.02).to(torch.bfloat16) for name in group}
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        sizes.append(sum(t.numel() * 2 for t in tensors.values()))
        weight_map.update({name: file for name in group})
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return sizes


def measure(argv: list[str]) -> dict:
    """Runs one conversion in a process of its own: its seconds and peak RSS (VmHWM). The dist-checkpoint
    writers megatron forks share the converter's pages copy-on-write and are not counted again."""
    process = subprocess.Popen([sys.executable, "-c", MEASURE, *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.communicate()
    line = [ln for ln in stdout.splitlines() if ln.startswith("MEASURE")]
    if process.returncode or not line:
        sys.exit(f"{' '.join(argv[:2])} failed: {stderr[-2000:]}")
    _, rc, seconds, hwm_kb = line[0].split()
    return {"seconds": float(seconds), "peak_rss_gb": int(hwm_kb) * 1024 / 1e9,
            "progress_lines": sum("convert: shard" in ln for ln in stderr.splitlines())}


def equal_dirs(a: Path, b: Path) -> int:
    """Compares every tensor of two HF directories, one tensor at a time; returns how many."""
    import torch
    from safetensors import safe_open

    def where(path):
        return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]

    wa, wb = where(a), where(b)
    if sorted(wa) != sorted(wb):
        sys.exit(f"names differ: {sorted(set(wa) ^ set(wb))[:5]}")
    for name in wa:
        with safe_open(str(a / wa[name]), "pt") as fa, safe_open(str(b / wb[name]), "pt") as fb:
            if not torch.equal(fa.get_tensor(name), fb.get_tensor(name)):
                sys.exit(f"{name} differs after the round trip")
    return len(wa)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="an empty or new directory for the three copies")
    parser.add_argument("--shard-gb", type=float, default=2.0, help="input shard size (default 2 GB)")
    parser.add_argument("--llm-layers", type=int, default=36, help="fewer language layers when disk is short")
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    config = dict(CONFIG_3B, num_hidden_layers=args.llm_layers)
    args.work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.work).free
    if free < 3.3 * 8e9 * args.llm_layers / 36:
        sys.exit(f"{free / 1e9:.0f} GB free under {args.work}: too little for three copies; pass --llm-layers")
    hf, mc, back = args.work / "hf", args.work / "mc", args.work / "back"
    start = time.time()
    sizes = write_random_checkpoint(hf, config, int(args.shard_gb * 1e9))
    print(f"wrote {len(sizes)} shards, {sum(sizes) / 1e9:.2f} GB (largest {max(sizes) / 1e9:.2f} GB) "
          f"in {time.time() - start:.0f} s", flush=True)
    half = args.llm_layers // 2
    to_mcore = measure(["convert", "hf-to-mcore", str(hf), str(mc), "--tensor-model-parallel-size", str(args.tp),
                        "--llm-pp-layers", f"[[{half},{args.llm_layers - half}]]", "--vit-pp-layers", "[[32,0]]"])
    to_hf = measure(["convert", "mcore-to-hf", str(mc), str(back), "--max-shard-size-gb", str(args.shard_gb)])
    start = time.time()
    count = equal_dirs(hf, back)
    report = {"model": f"Qwen2.5-VL-3B shapes ({args.llm_layers} language layers), bf16, random",
              "total_gb": sum(sizes) / 1e9, "shards": len(sizes), "largest_shard_gb": max(sizes) / 1e9,
              "hf_to_mcore": to_mcore, "mcore_to_hf": to_hf, "tensors_equal": count,
              "compare_seconds": time.time() - start}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
