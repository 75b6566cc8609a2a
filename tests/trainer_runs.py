"""Running the trainer (mm_adaptor.train.main) in this process, as a user's command runs it, and reading what it
wrote: its output (captured at the file descriptors, which its ranks write to) and its TensorBoard scalars, whose
losses are each iteration's own (Megatron's printed line averages an interval, and on a resumed run's first
iteration two)."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
import tempfile
from dataclasses import dataclass

# Megatron's fusions compile with torch.compile (seconds on each rank, minutes from a cold cache on the CPU): the
# tests turn them off unless they are the subject; dropout off, so that runs compare; no loader workers
QUICK = ["--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
         "--no-gradient-accumulation-fusion", "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
         "--log-interval", "1", "--eval-iters", "0"]
ITERATION = re.compile(r" iteration +(\d+)/ *\d+ \| consumed samples:.*")


@dataclass
class Run:
    status: int
    out: str
    err: str

    def iteration_lines(self) -> list[str]:
        return [m.group(0) for m in ITERATION.finditer(self.out)]

    def field(self, name: str) -> list[str]:
        """A field of every iteration line, e.g. field("lm loss")."""
        lines = "\n".join(self.iteration_lines())
        return [m.group(1) for m in re.finditer(rf"\| {re.escape(name)}: ([^|]+?) \|", lines)]


@contextlib.contextmanager
def captured_output():
    """What this process and its children write to file descriptors 1 and 2 meanwhile: the yielded list holds
    [out, err] once the block is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    texts: list[str] = []
    captured = [tempfile.TemporaryFile(mode="w+") for _ in range(2)]
    saved, streams = [os.dup(1), os.dup(2)], (sys.stdout, sys.stderr)
    try:
        for fd, file in zip((1, 2), captured):
            os.dup2(file.fileno(), fd)
        # Python's own writes too (a test session replaces sys.stdout and sys.stderr with its capture)
        sys.stdout, sys.stderr = (open(fd, "w", closefd=False) for fd in (1, 2))
        try:
            yield texts
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    finally:
        sys.stdout, sys.stderr = streams
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        texts.extend((file.seek(0), file.read())[1] for file in captured)
        for file in captured:
            file.close()


def train(argv: list[str]) -> Run:
    """mm_adaptor.train.main(argv) here, its and its ranks' output captured."""
    from mm_adaptor.train import main

    with captured_output() as texts:
        try:
            status = main(argv)
        except SystemExit as exc:  # the parser's one-line refusal
            status = exc.code
    return Run(status, *texts)


def scalars(directory, tag: str = "lm loss") -> dict[int, float]:
    """{iteration: value} of a TensorBoard scalar Megatron wrote under `directory` (its last rank writes them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = {}
    for path in sorted(glob.glob(f"{directory}/**/events.out.tfevents.*", recursive=True)):
        events = EventAccumulator(path, size_guidance={"scalars": 0})
        events.Reload()
        if tag in events.Tags()["scalars"]:
            values.update({event.step: event.value for event in events.Scalars(tag)})
    return values


def relative_differences(a: dict, b: dict) -> dict[int, float]:
    """Per iteration both have: |a - b| / |a|."""
    return {step: abs(a[step] - b[step]) / abs(a[step]) for step in sorted(a) if step in b}
