"""The benchmark scripts still run (tiny sizes): each checks its native path against the compared one first."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("script, args, rows", [
    ("ops.py", ["--tokens", "64", "--hidden", "64", "--dtype", "float32"], 8),
    ("moe_experts.py", ["--tokens", "64", "--hidden", "32", "--ffn", "16", "--experts", "2"], 4),
    ("vocab_parallel_ce.py", ["--tokens", "64", "--vocab-shard", "128", "--dtype", "float32", "--rounds", "1"], 3),
])
def test_benchmark_prints_its_table(script, args, rows):
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args, "--min-run-time", "0.01"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    header, *measured = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert len(measured) == rows and " ms " in header, done.stdout
    assert not any("nan" in line or "inf" in line for line in measured), done.stdout
