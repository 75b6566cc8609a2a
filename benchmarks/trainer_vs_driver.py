"""The trainer (Megatron-LM's loop) against the built-in driver it replaced, on the same tiny vision-language runs:
start-up seconds, time per iteration, peak resident memory per rank.

    python benchmarks/trainer_vs_driver.py --driver-site DIR [--iters 30] [--runs 2] [-- more arguments]

DIR holds the driver's mm_adaptor, installed from the commit before the trainer (3d01c9d):
    git worktree add /tmp/driver 3d01c9d && pip install --no-deps --target DIR /tmp/driver
Each command runs as a user runs it (`python -m mm_adaptor.cli train ...`, the driver's site first on PYTHONPATH for
the driver), alternating the two, RUNS times each, fresh processes every time. Measured per run:
- start-up: seconds from starting the command to its first iteration line, less that iteration's own time;
- per iteration: the median of the iteration lines' times after the first 5;
- peak memory: the largest VmHWM of the command's rank processes (read every 0.1 s while they run).
Both train the same model and data: qwen2_5_vl-tiny on its synthetic images and text, TP2 on 2 CPU ranks, fp32,
micro-batch 2, global batch 4, no evaluation, Megatron's fusions off (the driver has none), no loader workers."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import psutil

COMMON = ["--model", "qwen2_5_vl-tiny", "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
          "--global-batch-size", "4", "--seq-length", "64", "--lr", "1e-3", "--log-interval", "1"]
TRAINER_ONLY = ["--nproc-per-node", "2", "--eval-iters", "0", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
                "--no-gradient-accumulation-fusion", "--num-workers", "0", "--hidden-dropout", "0",
                "--attention-dropout", "0"]
DRIVER_ONLY = ["--nproc-per-node", "2"]
ELAPSED = re.compile(r"iteration +\d+/ *\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")


def _peak_rss(pid: int, stop: threading.Event, found: list) -> None:
    peak = 0
    while not stop.is_set():
        try:
            for child in psutil.Process(pid).children(recursive=True):
                with open(f"/proc/{child.pid}/status") as status:
                    for line in status:
                        if line.startswith("VmHWM:"):
                            peak = max(peak, int(line.split()[1]) * 1024)
        except (psutil.Error, OSError):
            pass
        time.sleep(0.1)
    found.append(peak)


def run(argv: list[str], env: dict) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mm_adaptor.cli", "train", *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    stop, peaks = threading.Event(), []
    watcher = threading.Thread(target=_peak_rss, args=(proc.pid, stop, peaks), daemon=True)
    watcher.start()
    first_line_at, elapsed = None, []
    for line in proc.stdout:
        found = ELAPSED.search(line)
        if found:
            if first_line_at is None:
                first_line_at = time.perf_counter()
            elapsed.append(float(found.group(1)))
    proc.wait()
    stop.set()
    watcher.join()
    if proc.returncode != 0 or not elapsed:
        raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}, {len(elapsed)} iteration lines")
    return {"startup_s": first_line_at - start - elapsed[0] / 1000, "iteration_ms": statistics.median(elapsed[5:]),
            "peak_bytes": peaks[0]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--driver-site", required=True, help="a directory holding the driver's mm_adaptor")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="more arguments for both")
    args = parser.parse_args(argv)
    base = {**os.environ, "MM_ADAPTOR_DEVICE": "cpu", "PYTHONWARNINGS": "ignore"}
    envs = {"driver": {**base, "PYTHONPATH": os.pathsep.join(filter(None, [args.driver_site,
                                                                           base.get("PYTHONPATH")]))},
            "trainer": base}
    commands = {"driver": [*COMMON, *DRIVER_ONLY, "--train-iters", str(args.iters), *args.extra],
                "trainer": [*COMMON, *TRAINER_ONLY, "--train-iters", str(args.iters), *args.extra]}
    results = {name: [] for name in commands}
    for _ in range(args.runs):
        for name in commands:  # alternating, so that the machine's drift falls on both
            results[name].append(run(commands[name], envs[name]))
    print("| | start-up (s) | per iteration (ms) | peak resident memory per rank (MiB) |")
    print("|---|---|---|---|")
    for name, rows in results.items():
        startup = statistics.median(r["startup_s"] for r in rows)
        iteration = statistics.median(r["iteration_ms"] for r in rows)
        peak = max(r["peak_bytes"] for r in rows) / 2**20
        print(f"| {name} | {startup:.1f} | {iteration:.1f} | {peak:.0f} |")
    ratio = {key: statistics.median(r[key] for r in results["trainer"]) /
             statistics.median(r[key] for r in results["driver"]) for key in ("startup_s", "iteration_ms")}
    peak_ratio = max(r["peak_bytes"] for r in results["trainer"]) / max(r["peak_bytes"] for r in results["driver"])
    print(f"| trainer / driver | {ratio['startup_s']:.2f}x | {ratio['iteration_ms']:.2f}x | {peak_ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
