"""A large messages data set's start-up: the data index built once (mm_adaptor.data.index) against a start that
validates every record, on a generated set of COUNT records that share 1,000 small images (so every image is in
the page cache; distinct images on a shared filesystem cost the old path far more).

    python benchmarks/data_index.py [--count 1000000] [--before-site DIR] [--workers N] [--out DIR]

DIR holds mm_adaptor from a commit before the index (f4dc7dd), for the old path:
    git worktree add /tmp/before f4dc7dd   (its checkout is the DIR: it imports from there)
Each measurement is a fresh process calling the validation pass a training start calls (mm_adaptor.data.validate,
the byte tokenizer, --seq-length 4096), with Qwen2.5-VL's image preprocessing:
- first build: the index built from nothing (a pool of --workers processes, default one per core);
- later start: the same call again, the index opened;
- memory: the process's peak resident set (VmHWM), and for a later start the growth of its resident set from
  before the call to after reading 10,000 random samples (what a rank holds for the data set);
- before: the old path's call, every start (it keeps no index)."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

SEQ = 4096
WORDS = ("the a red blue green small large circle square triangle picture shows left right above below next to "
         "and with of in on is are two three several one").split()

MEASURE = r"""
import json, os, random, resource, sys, time
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
path, cache, workers, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "new"
from mm_adaptor.data import load_tokenizer, validate
tokenizer = load_tokenizer(None)
before = rss()
started = time.perf_counter()
if new:
    report = validate(path, tokenizer, %d, skip_bad_samples=True, cache_dir=cache, workers=workers)
else:
    report = validate(path, tokenizer, %d, skip_bad_samples=True)
seconds = time.perf_counter() - started
rng = random.Random(0)
for _ in range(10000):
    report.samples[rng.randrange(len(report.samples))]
grown = rss() - before
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
import mm_adaptor
print(json.dumps({"module": mm_adaptor.__file__, "seconds": seconds, "samples": len(report.samples),
                  "bad": report.skipped, "grown": grown,
                  "peak": peak, "children_peak": children}))
""" % (SEQ, SEQ)


def generate(folder: str, count: int, images: int = 1000, seed: int = 0) -> str:
    """COUNT records (one image each, a prompt of 5-40 words, an answer of 10-400 words, a few bad ones) over
    `images` PNGs of 28 to 112 pixels a side."""
    from PIL import Image

    rng = random.Random(seed)
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    names = []
    for i in range(images):
        name = f"images/{i:04d}.png"
        size = (28 * rng.randint(1, 4), 28 * rng.randint(1, 4))
        Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3))).save(os.path.join(folder, name))
        names.append(name)
    path = os.path.join(folder, "data.jsonl")
    with open(path, "w") as f:
        for n in range(count):
            prompt = " ".join(rng.choices(WORDS, k=rng.randint(5, 40)))
            answer = " ".join(rng.choices(WORDS, k=int(min(400, 10 + rng.expovariate(1 / 80)))))
            image = names[rng.randrange(images)] if n % 10_000 != 9_999 else "images/missing.png"
            f.write(json.dumps({"messages": [{"role": "user", "content": "<image>" + prompt},
                                             {"role": "assistant", "content": answer}], "images": [image]}) + "\n")
    return path


def measure(path: str, cache: str, workers: int, site: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", MEASURE, path, cache, str(workers), "old" if site else "new"],
                          env=env, capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(path))  # not a checkout's root: `-c` puts the working folder first
    if site:
        assert json.loads(done.stdout.strip().splitlines()[-1])["module"].startswith(os.path.abspath(site)), \
            f"the old path imported another mm_adaptor: {done.stdout}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--before-site", default=None, help="a checkout of mm_adaptor before the index")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None, help="where the generated set goes (default: a temporary folder)")
    args = parser.parse_args()
    folder = args.out or tempfile.mkdtemp(prefix="data-index-")
    started = time.perf_counter()
    path = generate(folder, args.count)
    print(f"generated {args.count} records ({os.path.getsize(path) / 1e6:.0f} MB) in "
          f"{time.perf_counter() - started:.0f} s: {path}", file=sys.stderr)
    cache = os.path.join(folder, "index")
    rows = [("index, first build", measure(path, cache, args.workers, None)),
            ("index, later start", measure(path, cache, args.workers, None))]
    if args.before_site:
        rows.append(("before (every start)", measure(path, cache, args.workers, args.before_site)))
    print(f"\n{args.count} records, {os.cpu_count()} cores, {args.workers} index workers\n")
    print("| start | seconds | peak resident (process) | peak resident (pool workers) | resident growth, 10,000 "
          "samples read | samples / bad |")
    print("|---|---|---|---|---|---|")
    for name, m in rows:
        pool = f"{m['children_peak'] / 2**30:.2f} GiB" if name == rows[0][0] else "none"
        print(f"| {name} | {m['seconds']:.1f} | {m['peak'] / 2**30:.2f} GiB | {pool} "
              f"| {m['grown'] / 2**20:.0f} MiB | {m['samples']} / {m['bad']} |")


if __name__ == "__main__":
    main()
