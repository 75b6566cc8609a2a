"""What the converter benchmarks share: a conversion measured in a process of its own, random sharded checkpoints
of given shapes, and the tensor-by-tensor comparison of two directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# seconds, VmHWM, and the peak of RssAnon sampled every 20 ms: VmHWM also counts file-backed pages (the safetensors
# shards are read through mmap, the libraries are mapped), which the kernel can drop. VmHWM, not ru_maxrss:
# ru_maxrss keeps the benchmark parent's peak across fork and exec.
MEASURE = """import re, resource, sys, threading, time
from mm_adaptor.cli import main
peak, stop = [0], threading.Event()
def sample():
    while not stop.is_set():
        text = open("/proc/self/status").read()
        peak[0] = max(peak[0], int(re.search(r"RssAnon:\\s+(\\d+)", text).group(1)))
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
start = time.time()
rc = main(sys.argv[1:])
stop.set()
hwm_kb = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
print("MEASURE", rc, time.time() - start, hwm_kb, peak[0], flush=True)
sys.exit(rc)
"""


def measure(argv: list[str]) -> dict:
    """One conversion in a process of its own: seconds, peak RSS (VmHWM) and peak anonymous memory. The
    dist-checkpoint writers megatron forks share the converter's pages copy-on-write and are not counted again."""
    process = subprocess.Popen([sys.executable, "-c", MEASURE, *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.communicate()
    line = [ln for ln in stdout.splitlines() if ln.startswith("MEASURE")]
    if process.returncode or not line:
        sys.exit(f"{' '.join(argv[:2])} failed: {stderr[-2000:]}")
    _, rc, seconds, hwm_kb, anon_kb = line[0].split()
    return {"seconds": float(seconds), "peak_rss_gb": int(hwm_kb) * 1024 / 1e9,
            "peak_anon_gb": int(anon_kb) * 1024 / 1e9,
            "progress_lines": sum("convert: shard" in ln for ln in stderr.splitlines())}


def write_random_checkpoint(path: Path, config: dict, shapes: dict, shard_bytes: int) -> list[int]:
    """Random bf16 tensors of these shapes in shards of about shard_bytes, one shard in memory at a time; returns
    the shards' sizes."""
    import torch
    from safetensors.torch import save_file

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
