"""Converter benchmark with experts: a randomly initialised checkpoint with Qwen3-VL-30B-A3B's shapes (128 experts of
768 per MoE layer, hidden 2048, the 27-layer vision tower, untied embedding, bf16, sharded safetensors) but fewer
language layers (default 4 of 48: three copies of the whole 62 GB model fit neither the disk nor the time of a
small machine), converted HF -> Megatron -> HF by the `mm-adaptor convert` command, each direction in a process of
its own; prints seconds and peak resident memory (the process and its children) against the largest input shard,
then checks every tensor of the round trip is equal.

    python benchmarks/convert_qwen3_vl_moe.py --work /tmp/convert_moe_bench [--shard-gb 2] [--llm-layers 4]
        [--form fused|per_expert] [--tp 2] [--ep 8]

The experts are written as the installed transformers saves them (fused per layer, `mlp.experts.gate_up_proj`
0.8 GB and `down_proj` 0.4 GB, its layout named by config.json's transformers_version) or, with --form
per_expert, one gate/up/down set per expert; mcore-to-hf writes the installed transformers' fused form, so the
round trip is compared in that form. Peak RSS is VmHWM of the converting process; peak anonymous memory
(RssAnon, sampled) leaves out the file-backed pages VmHWM also counts (the input shards are read through mmap).
Needs about 3 x (1.5 + 1.25 x layers) GB of disk under --work (the script checks before writing); deletes
nothing."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from _convert_common import equal_dirs, measure, write_random_checkpoint

VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
          "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
          "deepstack_visual_indexes": [8, 16, 24], "hidden_act": "gelu_pytorch_tanh", "out_hidden_size": 2048,
          "model_type": "qwen3_vl_moe"}
TEXT_30B_A3B = {"model_type": "qwen3_vl_moe_text", "vocab_size": 151936, "hidden_size": 2048,
                "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                "rope_theta": 5000000, "max_position_embeddings": 262144, "attention_bias": False,
                "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
                "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "norm_topk_prob": True}


def config_30b_a3b(layers: int) -> dict:
    from importlib import metadata

    return {"model_type": "qwen3_vl_moe", "architectures": ["Qwen3VLMoeForConditionalGeneration"],
            "tie_word_embeddings": False, "image_token_id": 151655, "video_token_id": 151656,
            "vision_start_token_id": 151652, "vision_end_token_id": 151653, "torch_dtype": "bfloat16",
            "transformers_version": metadata.version("transformers"),  # the fused experts' layout is this one's
            "text_config": dict(TEXT_30B_A3B, num_hidden_layers=layers), "vision_config": VISION}


def shapes_of(config: dict, form: str) -> dict:
    """The HF names and shapes of the config as the installed transformers saves them (from its model on the meta
    device); per_expert: each fused experts tensor as its experts' gate/up/down Linear weights."""
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig.from_dict(config))
    fused_5 = int(config["transformers_version"].split(".")[0]) >= 5
    shapes = {}
    for name, tensor in model.state_dict().items():
        shape = tuple(tensor.shape)
        if form == "fused" or not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            shapes[name] = shape
            continue
        experts, out, into = (shape[0], shape[1], shape[2]) if fused_5 else (shape[0], shape[2], shape[1])
        prefix = name.rsplit(".", 1)[0]
        parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
        for e in range(experts):
            shapes.update({f"{prefix}.{e}.{part}.weight": (out // len(parts), into) for part in parts})
    return shapes


def equal_fused(per_expert: Path, back: Path, config: dict) -> int:
    """Compares a per-expert input with the fused output, each fused tensor against its experts fused here (one
    layer's experts in memory at a time); returns how many tensors."""
    import torch
    from safetensors import safe_open

    from mm_adaptor.convert.rules import fuse_experts

    def where(path):
        return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]

    def read(path, files, name):
        with safe_open(str(path / files[name]), "pt") as f:
            return f.get_tensor(name)

    source, target = where(per_expert), where(back)
    major = int(config["transformers_version"].split(".")[0])
    experts = config["text_config"]["num_experts"]
    for name in target:
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix = name.rsplit(".", 1)[0]
            parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            expected = fuse_experts([[read(per_expert, source, f"{prefix}.{e}.{part}.weight") for part in parts]
                                     for e in range(experts)], major)
        else:
            expected = read(per_expert, source, name)
        if not torch.equal(expected, read(back, target, name)):
            sys.exit(f"{name} differs after the round trip")
    return len(target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="an empty or new directory for the copies")
    parser.add_argument("--shard-gb", type=float, default=2.0, help="input and output shard size (default 2 GB)")
    parser.add_argument("--llm-layers", type=int, default=4, help="language layers (the real model has 48)")
    parser.add_argument("--form", choices=("fused", "per_expert"), default="fused")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=8)
    args = parser.parse_args()
    config = config_30b_a3b(args.llm_layers)
    args.work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.work).free
    if free < 3.3 * (1.5e9 + 1.25e9 * args.llm_layers):
        sys.exit(f"{free / 1e9:.0f} GB free under {args.work}: too little for three copies; pass fewer --llm-layers")
    hf, mc, back = args.work / "hf", args.work / "mc", args.work / "back"
    start = time.time()
    sizes = write_random_checkpoint(hf, config, shapes_of(config, args.form), int(args.shard_gb * 1e9))
    written = time.time() - start
    print(f"wrote {len(sizes)} shards, {sum(sizes) / 1e9:.2f} GB (largest {max(sizes) / 1e9:.2f} GB) "
          f"in {written:.0f} s", flush=True)
    half = args.llm_layers // 2
    to_mcore = measure(["convert", "hf-to-mcore", str(hf), str(mc), "--tensor-model-parallel-size", str(args.tp),
                        "--expert-model-parallel-size", str(args.ep),
                        "--llm-pp-layers", f"[[{half},{args.llm_layers - half}]]", "--vit-pp-layers", "[[27,0]]"])
    to_hf = measure(["convert", "mcore-to-hf", str(mc), str(back), "--max-shard-size-gb", str(args.shard_gb)])
    start = time.time()
    count = equal_dirs(hf, back) if args.form == "fused" else equal_fused(hf, back, config)
    report = {"model": f"Qwen3-VL-30B-A3B shapes ({args.llm_layers} of 48 language layers, 128 experts), bf16, "
                       f"random, experts {args.form}",
              "total_gb": sum(sizes) / 1e9, "shards": len(sizes), "largest_shard_gb": max(sizes) / 1e9,
              "write_seconds": written, "hf_to_mcore": to_mcore, "mcore_to_hf": to_hf, "tensors_equal": count,
              "compare_seconds": time.time() - start}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
