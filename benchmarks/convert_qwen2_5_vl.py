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
import sys
import time
from pathlib import Path

from _convert_common import equal_dirs, measure, write_random_checkpoint

VISION = {"depth": 32, "hidden_size": 1280, "hidden_act": "silu", "intermediate_size": 3420, "num_heads": 16,
          "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
          "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "out_hidden_size": 2048}
CONFIG_3B = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
             "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
             "num_attention_heads": 16, "num_key_value_heads": 2, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
             "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
             "max_position_embeddings": 128000, "hidden_act": "silu",
             "torch_dtype": "bfloat16", "vision_config": VISION}

def shapes_of(config: dict) -> dict:
    """The HF names and shapes of the config as 4.x-era checkpoints name them (from transformers on the meta
    device)."""
    import torch
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
    return shapes


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
    sizes = write_random_checkpoint(hf, config, shapes_of(config), int(args.shard_gb * 1e9))
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
