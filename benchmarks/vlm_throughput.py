"""A vision-language model's training throughput against transformers', side by side in one run: Qwen2.5-VL built
randomly initialised from an HF config (Qwen2.5-VL-3B's shapes on a device, a reduced model on the CPU), trained on
generated image data, the vision tower frozen (the projector trains), bf16, by

- `mm-adaptor train` (Megatron-LM's loop), packed to --seq tokens (--packing), without fused kernels;
- `mm-adaptor train`, packed, with --use-fused-rmsnorm --use-fused-swiglu --use-fused-rotary-pos-emb --use-flash-attn;
- the peer: transformers' own Qwen2_5_VLForConditionalGeneration in a plain PyTorch loop (AdamW, fp32 weights under
  bf16 autocast), the same samples of each step one per micro-batch, unpadded (its padding-free packed path needs
  flash-attn 2, which this peer does not assume).

Each run is a process of its own. Per run: non-padding tokens per second over the steps after the first, model
TFLOP/s from those tokens (the language model's training FLOPs with its attention, the projector's; and with the
frozen vision tower's forward), peak memory (the device allocator's peak on CUDA/NPU, the training process's peak
resident set (VmHWM) on the CPU) and the last loss; then the ratios to the peer.

    python benchmarks/vlm_throughput.py [--device cpu|cuda] [--seq N] [--samples N] [--steps N] [--llm-layers N]
                                        [--runs unfused,fused] [--train-args='ARGS'] [--start spawn|fork]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from _common import device_name, forked, package_version, train_as_a_user
from vlm_packing import make_data

FUSED = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn"]
RUNS = {"unfused": [], "fused": FUSED}  # the trainer runs: "mm-adaptor, <name>" rows
# (weight, image side): generated images of 4 x 4 to 32 x 32 patches (16 to 256 merged tokens)
MIX = ((0.4, 112), (0.4, 224), (0.2, 448))
CPU_MIX = ((0.5, 56), (0.5, 112))


def model_config(device: str, llm_layers: int | None) -> dict:
    """The HF config dict: Qwen2.5-VL-3B's shapes on a device; on the CPU a reduced model with the tiny preset's
    vocabulary and token ids."""
    if device != "cpu":
        from convert_qwen2_5_vl import CONFIG_3B

        return dict(CONFIG_3B, num_hidden_layers=llm_layers or CONFIG_3B["num_hidden_layers"])
    import dataclasses

    from mm_adaptor.models.qwen2_5_vl import tiny_config, tiny_hf_config_dict

    reduced = dataclasses.replace(tiny_config(), hidden_size=256, ffn_hidden_size=688, num_layers=llm_layers or 4,
                                  num_attention_heads=8, num_query_groups=2, vision_depth=4, vision_hidden_size=128,
                                  vision_ffn_hidden_size=256, vision_num_heads=4, fullatt_block_indexes=(1, 3),
                                  mrope_section=(4, 6, 6))
    return tiny_hf_config_dict(reduced)


def step_flops(hf: dict, samples: list[tuple[int, list]]) -> tuple[float, float]:
    """(training FLOPs of the language model and projector, the frozen vision tower's forward FLOPs) of samples
    [(tokens, image grids)]: 6 per parameter and token for trained matmuls, 2 for the forward only; attention 6 n^2 h
    per causal language layer (12 n^2 h / 2), 4 p^2 h per full vision layer and 4 p w h per windowed one."""
    v = hf["vision_config"]
    h, f, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    kv = h // hf["num_attention_heads"] * hf["num_key_value_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * f
    lm_params = layers * per_layer + hf["vocab_size"] * h  # the output layer's matmul
    vh, vf, depth = v["hidden_size"], v["intermediate_size"], v["depth"]
    merge = v["spatial_merge_size"] ** 2
    vit_params = depth * (4 * vh * vh + 3 * vh * vf) + 3 * v["patch_size"] ** 2 * v["temporal_patch_size"] * vh
    projector_params = (vh * merge) ** 2 + vh * merge * h
    window = (v["window_size"] // v["patch_size"]) ** 2
    full = len(v["fullatt_block_indexes"])
    language = vision = 0.0
    for tokens, grids in samples:
        language += 6 * lm_params * tokens + 6 * layers * tokens * tokens * h
        for t, gh, gw in grids:
            patches = t * gh * gw
            language += 6 * projector_params * patches / merge
            vision += 2 * vit_params * patches + 4 * patches * vh * (full * patches + (depth - full) * window)
    return language, vision


def peer(opts) -> dict:
    """The transformers loop (in a process of its own): tokens/s after the first step, peak memory, last loss."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from mm_adaptor.data import load_tokenizer
    from mm_adaptor.data.vlm import build
    from mm_adaptor.devices.memory import peak_bytes
    from mm_adaptor.models.qwen2_5_vl import config_from_hf

    hf = json.loads(open(opts.config).read())
    ours = config_from_hf(hf)
    device = torch.device(opts.device)
    torch.manual_seed(opts.seed)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**hf)).to(device).train()
    visual = getattr(model, "visual", None) or model.model.visual
    for name, param in visual.named_parameters():
        param.requires_grad_(name.startswith("merger."))  # the projector trains, as with --freeze-vision
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    batches = build(opts.data, load_tokenizer(None, ours), ours, opts.seq, 1, opts.samples, seed=opts.seed)
    takes_token_types = "mm_token_type_ids" in __import__("inspect").signature(model.model.forward).parameters
    tokens = seconds = 0.0
    loss = None
    for step in range(opts.steps):
        start, step_tokens = time.perf_counter(), 0
        for _ in range(opts.samples):
            batch = next(batches)
            n = int(batch["num_tokens"][0])
            ids, labels = batch["input_ids"][:, :n].to(device), batch["labels"][:, :n]
            shifted = torch.cat([torch.full_like(labels[:, :1], -100), labels[:, :-1]], dim=1).to(device)
            extra = {"mm_token_type_ids": (ids == ours.image_token_id).int()} if takes_token_types else {}
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(input_ids=ids, labels=shifted, pixel_values=batch["pixel_values"].to(device),
                            image_grid_thw=batch["image_grid_thw"].to(device), **extra)
            (out.loss / opts.samples).backward()
            step_tokens += n
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = float(out.loss)
        if device.type != "cpu":
            getattr(torch, device.type).synchronize()
        if step:
            tokens, seconds = tokens + step_tokens, seconds + time.perf_counter() - start
    return {"tokens_per_second": tokens / seconds, "peak_bytes": peak_bytes(device), "loss": loss}


def ours(opts, extra: list[str]) -> dict:
    argv = ["--hf-config", opts.config, "--data-path", opts.data, "--seq-length", str(opts.seq),
            "--micro-batch-size", "1", "--global-batch-size", str(opts.samples), "--train-iters", str(opts.steps),
            "--seed", str(opts.seed), "--packing", "--freeze-vision", "--bf16", "--nproc-per-node", "1", "--lr", "1e-5",
            "--calculate-per-token-loss", "--attention-dropout", "0", "--eval-iters", "0", *extra,
            *shlex.split(opts.train_args)]
    return train_as_a_user(argv, fork=opts.start == "fork")


def timed_samples(opts) -> list[tuple[int, list]]:
    """(tokens, grids) of the samples of every step after the first: the ones the tokens/s figures count."""
    from mm_adaptor.data import load_tokenizer, validate
    from mm_adaptor.data.vlm import global_batch_indices
    from mm_adaptor.models.qwen2_5_vl import config_from_hf

    config = config_from_hf(json.loads(open(opts.config).read()))
    report = validate(opts.data, load_tokenizer(None, config), opts.seq)
    chosen = [i for step in range(1, opts.steps)
              for i in global_batch_indices(step, opts.samples, len(report.samples), opts.seed)]
    return [(report.samples[i].length, [tuple(g) for g in report.samples[i].grids]) for i in chosen]


def run_arguments(description: str) -> argparse.ArgumentParser:
    """The model and run sizes of the trainer benchmarks on this model (this one, lora.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=["cpu", "cuda", "npu"], default="cpu")
    parser.add_argument("--seq", type=int, default=None, help="pack length (default 4096 on a device, 1024 on the CPU)")
    parser.add_argument("--samples", type=int, default=None, help="samples per step (default 64 on a device, 16 on "
                                                                  "the CPU)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--llm-layers", type=int, default=None, help="language layers (default: the model's, 4 on "
                                                                     "the CPU)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--train-args", default="", help="more `mm-adaptor train` arguments for every trainer run "
                                                         "(one string, e.g. --train-args='--no-bias-swiglu-fusion')")
    parser.add_argument("--start", choices=["spawn", "fork"], default="spawn",
                        help="how each run's process starts: fork shares this process's imports (CPU only)")
    return parser


def sized(opts):
    """The device's default sizes where none were given."""
    opts.seq = opts.seq or (1024 if opts.device == "cpu" else 4096)
    opts.samples = opts.samples or (16 if opts.device == "cpu" else 64)
    return opts


def main() -> None:
    parser = run_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS), help=f"trainer runs, a subset of {','.join(RUNS)} (the peer "
                                                                 "always runs)")
    parser.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    opts = sized(parser.parse_args())
    runs = opts.runs.split(",")
    if set(runs) - set(RUNS):
        parser.error(f"--runs: unknown {', '.join(sorted(set(runs) - set(RUNS)))}; choose from {', '.join(RUNS)}")
    if opts.peer_worker:
        print("PEER " + json.dumps(peer(opts)), flush=True)
        return
    hf = model_config(opts.device, opts.llm_layers)
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        opts.config = os.path.join(folder, "config.json")
        with open(opts.config, "w") as f:
            json.dump(hf, f)
        opts.data = make_data(folder, 4 * opts.samples, opts.seed, CPU_MIX if opts.device == "cpu" else MIX)
        timed = timed_samples(opts)
        language, vision = step_flops(hf, timed)
        tokens = sum(n for n, _ in timed)
        for run in runs:
            rows[f"mm-adaptor, {run}"] = ours(opts, RUNS[run])
        if opts.start == "fork":
            code, stdout, stderr = forked(lambda: print("PEER " + json.dumps(peer(opts)), flush=True))
        else:
            argv = [a for a in sys.argv[1:]] + ["--peer-worker", "--config", opts.config, "--data", opts.data,
                                               "--seq", str(opts.seq), "--samples", str(opts.samples)]
            done = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], capture_output=True, text=True)
            code, stdout, stderr = done.returncode, done.stdout, done.stderr
        line = [ln for ln in stdout.splitlines() if ln.startswith("PEER ")]
        if code or not line:
            sys.exit(f"the transformers peer failed: {stderr[-3000:]}")
        rows["transformers (peer)"] = json.loads(line[0][5:])
    print(f"# {device_name(opts.device)}, torch {package_version('torch')}, megatron-core "
          f"{package_version('megatron-core')}, transformers {package_version('transformers')}; Qwen2.5-VL "
          f"({'3B shapes' if opts.device != 'cpu' else 'reduced'}: {hf['num_hidden_layers']} language layers, hidden "
          f"{hf['hidden_size']}, vision depth {hf['vision_config']['depth']}), random, vision tower frozen, bf16; "
          f"{opts.samples} samples per step, packs of {opts.seq}, {opts.steps} steps (the first left out)")
    print("| run | non-padding tokens/s | model TFLOP/s (ViT not counted) | with the ViT's forward | peak memory | "
          "last loss | tokens/s / peer | peak memory / peer |")
    print("|---|---|---|---|---|---|---|---|")
    base = rows["transformers (peer)"]
    for name, r in rows.items():
        rate = r["tokens_per_second"]
        flops = rate / tokens * language / 1e12, rate / tokens * (language + vision) / 1e12
        print(f"| {name} | {rate:.0f} | {flops[0]:.3g} | {flops[1]:.3g} | {r['peak_bytes'] / 2**30:.2f} GiB | "
              f"{r['loss']:.4f} | {rate / base['tokens_per_second']:.2f}x | "
              f"{r['peak_bytes'] / base['peak_bytes']:.2f}x |")


if __name__ == "__main__":
    main()
