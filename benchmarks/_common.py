"""Pieces the benchmark scripts share: timing and the Markdown table they print."""

from __future__ import annotations

import platform

import torch
from torch.utils import benchmark


def median_ms(fn, min_run_time: float) -> float:
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def print_table_header(setup: str, columns: list[str]) -> None:
    """One line naming the machine and the setup, then a Markdown table header."""
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {setup}")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns), flush=True)
