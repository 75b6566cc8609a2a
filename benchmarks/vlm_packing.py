"""--packing for a vision-language model against padding, side by side in one run: the driver trains the tiny
Qwen2.5-VL on a generated skewed messages data set (text-only questions beside small and large images, most samples
short), one sample per micro-batch padded to --seq-length, then packed first-fit decreasing into rows of it.

Per configuration: the non-padding share of the processed tokens, micro-batches per step, non-padding tokens per
second over the timed steps, and rank 0's saved activation bytes of one micro-batch (the driver's recorder: language
and vision layers and outside them; a pack holds several samples, a padded row one).

    python benchmarks/vlm_packing.py [--seq 2048] [--samples 64] [--steps 3] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

from _common import device_name, package_version, train_as_a_user

# (weight, image side or None): text-only questions beside small and large images (large: 32 x 32 patches, 256
# merged tokens; small: 4 x 4 patches)
MIX = ((0.5, None), (0.3, 56), (0.2, 448))


def make_data(out_dir: str, count: int, seed: int, mix=MIX) -> str:
    """A messages data set: per sample an image side drawn from `mix` ((weight, side or None for text only))."""
    from PIL import Image

    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    records = []
    for i in range(count):
        side = rng.choices([s for _, s in mix], weights=[w for w, _ in mix])[0]
        words = " ".join(rng.choice(("red", "blue", "circle", "square", "two", "large")) for _ in
                         range(int(4 + 60 * rng.random() ** 3)))
        if side is None:
            records.append({"messages": [{"role": "user", "content": "Say it back: " + words},
                                         {"role": "assistant", "content": words}]})
            continue
        relative = os.path.join("images", f"{i:05d}.png")
        Image.new("RGB", (side, side), tuple(rng.randrange(256) for _ in range(3))).save(
            os.path.join(out_dir, relative))
        records.append({"messages": [{"role": "user", "content": "<image>What colour is it?"},
                                     {"role": "assistant", "content": words}], "images": [relative]})
    path = os.path.join(out_dir, "skewed.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(records, f)
    return path


def sample_lengths(data: str, seq: int) -> list[int]:
    from mm_adaptor.data import load_tokenizer, validate
    from mm_adaptor.models.qwen2_5_vl import tiny_config

    return [s.length for s in validate(data, load_tokenizer(None, tiny_config()), seq).samples]


def saved_bytes_per_layer(argv: list[str]) -> int:
    """Bytes saved for backward per language layer in one micro-batch (the check harness's runner measures it)."""
    from mm_adaptor.harness import runner

    dump = runner.run(runner.parse_args([*argv, "--train-iters", "1"]))
    return sum(dump.memory["saved_bytes_per_layer"].values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=64, help="samples per step (the packing window)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    from mm_adaptor.data.packing import first_fit_decreasing
    from mm_adaptor.data.vlm import global_batch_indices

    with tempfile.TemporaryDirectory() as folder:
        data = make_data(folder, 4 * args.samples, args.seed)
        lengths = sample_lengths(data, args.seq)
        base = ["--model", "qwen2_5_vl-tiny", "--data-path", data, "--num-layers", str(args.layers),
                "--seq-length", str(args.seq), "--micro-batch-size", "1", "--global-batch-size", str(args.samples),
                "--seed", str(args.seed), "--nproc-per-node", "1"]
        real = packs = 0
        for step in range(args.steps):
            chosen = [lengths[i] for i in global_batch_indices(step, args.samples, len(lengths), args.seed)]
            real += sum(chosen)
            packs += len(first_fit_decreasing(chosen, args.seq))
        rows = {}
        for name, extra in (("padded", []), ("packed", ["--packing"])):
            run = train_as_a_user([*base, *extra, "--train-iters", str(args.steps), "--calculate-per-token-loss",
                                   "--attention-dropout", "0", "--eval-iters", "0"])
            micro = args.steps * args.samples if name == "padded" else packs
            saved = saved_bytes_per_layer([*base, *extra])
            rows[name] = (micro / args.steps, real / (micro * args.seq), run["tokens_per_second"], saved, run["loss"])
    print(f"# {device_name('cpu')}, megatron-core {package_version('megatron-core')}; tiny Qwen2.5-VL, "
          f"{args.layers} language layers, fp32, seq {args.seq}, {args.samples} samples per step ({MIX[0][0]:.0%} "
          f"text only, {MIX[1][0]:.0%} {MIX[1][1]}px, {MIX[2][0]:.0%} {MIX[2][1]}px images), {args.steps} steps, "
          f"one rank; tokens/s: Megatron's iteration lines (--log-tps, every step but the first)")
    print("| batches | micro-batches per step | non-padding of processed | non-padding tokens/s | "
          "saved bytes of one micro-batch | last loss |")
    print("|---|---|---|---|---|---|")
    for name, (micro, share, rate, saved, loss) in rows.items():
        print(f"| {name} | {micro:.1f} | {share:.1%} | {rate:.0f} | {saved / 2**20:.1f} MiB | {loss:.6f} |")
    print(f"packed / padded non-padding tokens/s: {rows['packed'][2] / rows['padded'][2]:.2f}x; padding removed: "
          f"{rows['packed'][1] / rows['padded'][1]:.2f}x the processed tokens")


if __name__ == "__main__":
    main()
