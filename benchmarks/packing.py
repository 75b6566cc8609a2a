"""--packing against padding, measured side by side in one run: the same skewed-length samples (the driver's
`--mock-lengths skewed`: 1/16 of --seq to all of it, u^3, most short) trained one per micro-batch padded to --seq
(megatron's attention, loss masked on the padding) and packed first-fit decreasing into rows of --seq
(PackedSeqParams through mm_adaptor.ops.varlen_attention), on one rank, a Llama-like GPT.

Per configuration: the padding fraction of the processed tokens, micro-batches per step, median step time and
non-padding tokens per second, the saved activation bytes of one micro-batch (the peak of a plain loop, each
micro-batch's activations freed by its backward) and per non-padding token. The configurations alternate step by
step after a warm-up step each.

    python benchmarks/packing.py                                  # the device torch sees, fp32
    python benchmarks/packing.py --device cpu --seq 512 --samples 32 --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import device_name, init_single_rank, llama_like_driver_options, package_version


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--samples", type=int, default=64, help="samples per step (the packing window)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration, after one warm-up step")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    args.micro_batch = 1
    return args


def data(options, packed: bool, device):
    from mm_adaptor.data.packing import PackedBatches, text_sample
    from mm_adaptor.train.data import MockBatches

    mock = MockBatches(options, 0, 0, device)
    if packed:
        return PackedBatches(options, 0, 0, device, lambda g: text_sample(mock.sample(g)))
    return mock


def run_step(model, batches, packed: bool, options, accountant=None):
    """One step: every micro-batch forward and backward (the loss per token over the step); returns (seconds,
    micro-batches, non-padding tokens, processed tokens, saved bytes of the first micro-batch or None)."""
    if packed:
        batches.start_step()
        count = batches.microbatches_this_step
    else:
        count = options.num_microbatches
    micro = [next(batches) for _ in range(count)]
    real = sum(int(b["loss_mask"].sum()) for b in micro)
    saved = None
    start = time.perf_counter()
    for i, b in enumerate(micro):
        kwargs = {"packed_seq_params": b["packed_seq_params"]} if packed else {}
        measuring = accountant is not None and i == 0
        if measuring:
            accountant.saved.clear()
            context = accountant.hooks()
            context.__enter__()
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"], **kwargs)
        loss = (out.float() * b["loss_mask"]).sum() / real
        if measuring:
            context.__exit__(None, None, None)
            saved = sum(accountant.bytes_per_layer("device").values())
        loss.backward()
    if options.device_type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, count, real, count * options.seq_length, saved


def main() -> None:
    args = parse()
    device = torch.device(args.device)
    init_single_rank()
    from mm_adaptor import devices
    from mm_adaptor.devices.memory import SavedTensorAccountant
    from mm_adaptor.patches.transformer.packed_attention import patch_set
    from mm_adaptor.harness.runner.model import build_model, transformer_config

    devices.install()
    options = llama_like_driver_options(args, "--mock-lengths", "skewed", "--global-batch-size", str(args.samples),
                                        "--seed", str(args.seed))
    options.device_type = device.type
    from megatron.core import tensor_parallel

    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    model = build_model(options, transformer_config(options), device)[0]
    accountant = SavedTensorAccountant([model])
    patches = patch_set()
    patches.apply()
    try:
        streams = {name: data(options, name == "packed", device) for name in ("padded", "packed")}
        figures = {name: [] for name in streams}
        saved = {}
        for name, batches in streams.items():  # warm-up, and the saved bytes of one micro-batch
            saved[name] = run_step(model, batches, name == "packed", options, accountant)[4]
        for _ in range(args.steps):
            for name, batches in streams.items():
                figures[name].append(run_step(model, batches, name == "packed", options))
                model.zero_grad(set_to_none=True)
    finally:
        patches.revert()
    print(f"# {device_name(args.device)}, torch {torch.__version__}, megatron-core {package_version('megatron-core')}; "
          f"{args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, {args.heads} heads, seq {args.seq}, "
          f"{args.samples} samples per step, fp32, {args.steps} timed steps (medians)")
    print("| batches | micro-batches per step | non-padding of processed | step (ms) | non-padding tokens/s | "
          "saved bytes per micro-batch | saved bytes per non-padding token |")
    print("|---|---|---|---|---|---|---|")
    rates = {}
    for name, rows in figures.items():
        seconds = statistics.median(r[0] for r in rows)
        real, processed = sum(r[2] for r in rows), sum(r[3] for r in rows)
        rates[name] = real / sum(r[0] for r in rows)
        per_step_real = real / len(rows)
        print(f"| {name} | {statistics.mean(r[1] for r in rows):.1f} | {real / processed:.1%} | {seconds * 1e3:.0f} | "
              f"{rates[name]:.0f} | {saved[name] / 2**20:.1f} MiB | "
              f"{saved[name] * statistics.mean(r[1] for r in rows) / per_step_real / 1024:.1f} KiB |")
    padded_fraction = sum(r[2] for r in figures["padded"]) / sum(r[3] for r in figures["padded"])
    print(f"packed / padded non-padding tokens/s: {rates['packed'] / rates['padded']:.2f}x; padding removed: "
          f"{1 / padded_fraction:.2f}x the processed tokens")


if __name__ == "__main__":
    main()
