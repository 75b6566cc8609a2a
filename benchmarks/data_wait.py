"""The data wait on the iteration line with and without loader workers, on a step where decoding dominates: the tiny
Qwen2.5-VL (its compute is small) on records whose images are large noisy PNGs (slow to decode and resize).

    python benchmarks/data_wait.py [--workers 0 2 4] [--iters 12] [--images 64] [--side 1344] [--max-pixels 12544]

Each run is `mm-adaptor train` on one CPU rank, fresh, with the same data and seed; measured per run, over the
iterations after the first 2: the median of the iteration line's `data wait (ms, slowest rank)` and of its
`elapsed time per iteration (ms)`, and the wait's share of the iteration."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

WAIT = re.compile(r"data wait \(ms, slowest rank\): ([\d.]+)")
ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")


def make_data(folder: str, images: int, side: int) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    records = []
    for i in range(images):
        name = f"{i:03d}.png"
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(os.path.join(folder, name))
        records.append({"messages": [{"role": "user", "content": "<image>Describe the noise."},
                                     {"role": "assistant", "content": "Grey static."}], "images": [name]})
    path = os.path.join(folder, "data.json")
    with open(path, "w") as f:
        json.dump(records, f)
    return path


def run(data: str, workers: int, iters: int, max_pixels: int, cache: str) -> tuple[float, float]:
    tokens = max_pixels // 28**2 + 128  # the image pads and the template (in bytes)
    command = [sys.executable, "-m", "mm_adaptor.cli", "train", "--nproc-per-node", "1", "--model", "qwen2_5_vl-tiny",
               "--data-path", data, "--split", "100,0,0", "--seq-length", str(tokens), "--micro-batch-size", "1",
               "--global-batch-size", "4", "--train-iters", str(iters), "--lr", "1e-4", "--log-interval", "1",
               "--eval-iters", "0", "--num-workers", str(workers), "--data-cache", cache,
               "--image-max-pixels", str(max_pixels)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    waits = [float(v) for v in WAIT.findall(done.stdout)][2:]
    elapsed = [float(v) for v in ELAPSED.findall(done.stdout)][2:]
    return statistics.median(waits), statistics.median(elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--side", type=int, default=1344)
    parser.add_argument("--max-pixels", type=int, default=112 * 112)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="data-wait-")
    data = make_data(folder, args.images, args.side)
    rows = [(w, *run(data, w, args.iters, args.max_pixels, os.path.join(folder, "index"))) for w in args.workers]
    print(f"\n{args.images} PNGs of {args.side}x{args.side} noise resized to at most {args.max_pixels} pixels, "
          f"global batch 4, {os.cpu_count()} cores\n")
    print("| --num-workers | data wait (ms) | iteration (ms) | wait / iteration |")
    print("|---|---|---|---|")
    for workers, wait, elapsed in rows:
        print(f"| {workers} | {wait:.1f} | {elapsed:.1f} | {100 * wait / elapsed:.1f}% |")


if __name__ == "__main__":
    main()
