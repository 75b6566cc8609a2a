"""The test command's time guard. CI's hard limit is 90 minutes and machines differ by about 1.5x (the same clean
clone took 32.8 min on one and 47.7 on another; on 2026-11-29 this machine ran about 2.5x slower than on 11-27), so
the guard warns past 45 minutes, where the suite's growth should be looked at, and fails CI only past 60, where a slow
machine would come near the hard limit. Given the command's
measured seconds and the per-file times its legs recorded (tests/conftest.py), it prints one line with the total and
the slowest files; past either line it names the files that grew most since the recorded breakdown
(tests/time_budget.json).

    python scripts/time_budget.py SECONDS TIMES.json [--record]   (--record: write TIMES as the new breakdown)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

WARN_S = 45 * 60
FAIL_S = 60 * 60
RECORDED = Path(__file__).resolve().parents[1] / "tests" / "time_budget.json"


def per_file(times: dict) -> dict[str, float]:
    """'leg: file' -> seconds, over every leg."""
    return {f"{leg}: {name}": seconds
            for leg, files in times.get("legs", {}).items() for name, seconds in files.items()}


def grown(now: dict[str, float], before: dict[str, float], count: int = 5) -> list[str]:
    deltas = sorted(((seconds - before.get(name, 0.0), name) for name, seconds in now.items()), reverse=True)
    return [f"{name} (+{delta:.0f} s{'' if name in before else ', new'})"
            for delta, name in deltas[:count] if delta > 0]


def main(argv: list[str]) -> int:
    seconds, times_path = float(argv[0]), Path(argv[1])
    now = per_file(json.loads(times_path.read_text())) if times_path.exists() else {}
    if "--record" in argv:
        RECORDED.write_text(json.dumps({"seconds": round(seconds), **json.loads(times_path.read_text())}, indent=1,
                                       sort_keys=True) + "\n")
    slowest = ", ".join(f"{name} {s:.0f} s" for s, name in sorted(((s, n) for n, s in now.items()), reverse=True)[:3])
    print(f"time guard: the test command took {seconds / 60:.1f} min (warns past {WARN_S // 60}, fails CI past "
          f"{FAIL_S // 60}); slowest files: {slowest or 'none recorded'}")
    if seconds <= WARN_S:
        return 0
    before = per_file(json.loads(RECORDED.read_text())) if RECORDED.exists() else {}
    what_grew = ', '.join(grown(now, before)) or 'nothing recorded grew (the machine is slower?)'
    if seconds <= FAIL_S:
        print(f"time guard: warning, past {WARN_S // 60} min by {(seconds - WARN_S) / 60:.1f} min; "
              f"grew most since tests/time_budget.json: {what_grew}")
        return 0
    print(f"time guard: over the {FAIL_S // 60}-minute limit by {(seconds - FAIL_S) / 60:.1f} min; "
          f"grew most since tests/time_budget.json: {what_grew}")
    return 1 if os.environ.get("CI") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
