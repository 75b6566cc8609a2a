"""End to end: Megatron-LM's own pretrain_gpt.py on one device, unpatched and with the adaptor's flags.

python benchmarks/megatron_lm_e2e.py --megatron-lm /path/to/Megatron-LM [--device cuda|cpu] [--variants ...]
       [--num-layers 8 --hidden-size 2048 ...] [-- more pretrain_gpt.py arguments]

Each variant runs `torchrun --standalone --nproc-per-node N` (default 1) on a small wrapper (this file with --worker)
that puts the Megatron-LM checkout first on sys.path, imports `mm_adaptor.megatron_adaptor` (all variants but
"unpatched") and runs pretrain_gpt.py with runpy, so no edited copy of the script is needed. Mock data, local
spec, RMSNorm, SwiGLU, RoPE; dropout off so the losses compare. Megatron-LM's fusion defaults that need
Transformer Engine or Apex are switched off (BASELINE_FLAGS) so the unpatched script runs too; every variant
gets the same command line plus its own flags.

From Megatron's log: "elapsed time per iteration (ms)" (median over the iterations after --warmup-iters),
"lm loss" and the "max allocated" of its memory reports (--log-memory-interval); the wrapper also prints every
iteration's exact lm loss from training_log's loss_dict, which the loss comparisons use. Exits non-zero when
the import without flags changes any loss bit, or when a variant fails.

On the CPU (--device cpu: MM_ADAPTOR_DEVICE=cpu, gloo, fp32, tiny model) only the adaptor's variants can run:
unpatched Megatron-LM requires CUDA, so the import without flags is the reference there.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

FUSED_FLAGS = ("--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn")
# name -> (label, imports the adaptor, flags)
VARIANTS = {
    "unpatched": ("unpatched", False, ()),
    "import": ("import, no flag", True, ()),
    "fused-rmsnorm": ("--use-fused-rmsnorm", True, ("--use-fused-rmsnorm",)),
    "fused-swiglu": ("--use-fused-swiglu", True, ("--use-fused-swiglu",)),
    "fused-rotary-pos-emb": ("--use-fused-rotary-pos-emb", True, ("--use-fused-rotary-pos-emb",)),
    "flash-attn": ("--use-flash-attn", True, ("--use-flash-attn",)),
    "all": ("all four", True, FUSED_FLAGS),
    # features whose loss lines must equal the import's digit for digit (exact, not fused kernels)
    "recompute-activation-function": ("--recompute-activation-function", True, ("--recompute-activation-function",)),
    "swap-attention": ("--swap-attention", True, ("--swap-attention", "--swap-min-bytes", "0")),
    "optimize-vocab-parallel-ce": ("--optimize-vocab-parallel-ce", True, ("--optimize-vocab-parallel-ce",)),
    # features that act only in a parallel layout: give it to every variant (--nproc-per-node 2 -- layout flags),
    # the import without flags in the same layout being the reference (benchmarks/RESULTS.md has the commands)
    "coc": ("--use-coc", True, ("--use-coc",)),
    "vpp-extra-warmup": ("--vpp-extra-warmup", True, ("--vpp-extra-warmup",)),
    # Megatron-LM refuses --moe-grouped-gemm without a GPU; with the feature it builds the same experts (0.17+)
    "fused-gmm": ("--use-fused-gmm", True, ("--use-fused-gmm", "--moe-grouped-gemm")),
    "reuse-fp32-param": ("--reuse-fp32-param", True, ("--reuse-fp32-param",)),
    "swap-optimizer": ("--swap-optimizer", True, ("--swap-optimizer",)),
    "virtual-optimizer": ("--virtual-optimizer", True, ("--virtual-optimizer", "1")),
    # MoE: give every variant --num-experts (and a layout: -- --num-experts 4 --expert-model-parallel-size 2 ...)
    "moe-zero-memory-level0": ("--moe-zero-memory level0", True, ("--moe-zero-memory", "level0")),
    "moe-zero-memory-level1": ("--moe-zero-memory level1", True, ("--moe-zero-memory", "level1")),
    "moe-alltoall-overlap-comm": ("--moe-alltoall-overlap-comm", True, ("--moe-alltoall-overlap-comm",)),
    # calibrated: its loss lines are within tolerance of the import's, not equal
    "balanced-moe-experts": ("--balanced-moe-experts", True, ("--balanced-moe-experts",
                                                             "--balanced-moe-hot-expert-num", "1")),
    "moe-tp-extend-ep": ("--moe-tp-extend-ep", True, ("--moe-tp-extend-ep",)),  # calibrated too
}
DEFAULT_VARIANTS = ("unpatched", "import", "fused-rmsnorm", "fused-swiglu", "fused-rotary-pos-emb", "flash-attn", "all")
# (cuda, cpu) defaults of the model options
MODEL_DEFAULTS = {
    "num_layers": (8, 2), "hidden_size": (2048, 64), "num_attention_heads": (16, 4), "seq_length": (4096, 64),
    "micro_batch_size": (2, 2), "vocab_size": (32000, 1024), "train_iters": (30, 6), "warmup_iters": (5, 2),
}
# Megatron-LM defaults that unpatched Megatron-LM cannot serve without Transformer Engine / Apex
BASELINE_FLAGS = ("--no-rope-fusion", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
                  "--no-masked-softmax-fusion")
LOSS_PROBE = "[mm-e2e]"

ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
LM_LOSS = re.compile(r"\| lm loss: ([-+.\dEenaif]+) \|")
MEMORY_LINE = re.compile(r"\(after \d+ iterations\) memory \(MB\) \| allocated: [\d.]+ \| max allocated: ([\d.]+)")
ERROR_LINE = re.compile(r"Error|error:|Exception|Traceback|assert|Killed")
PROBE_LINE = re.compile(re.escape(LOSS_PROBE) + r" iteration (\d+) lm loss: (\S+)")


# ---- the worker torchrun starts ----

def worker(argv: list[str]) -> None:
    """--worker {adaptor,plain} /path/to/pretrain_gpt.py ARGS..."""
    mode, script, *rest = argv
    script = os.path.abspath(script)
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(script)  # as `python pretrain_gpt.py` would: the checkout's megatron first
    if mode == "adaptor":
        import mm_adaptor.megatron_adaptor  # noqa: F401
    install_loss_probe()
    import runpy

    runpy.run_path(script, run_name="__main__")


def last_rank() -> bool:
    """One rank prints the probe (the last holds the loss in every layout; ranks' lines would interleave)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def install_loss_probe() -> None:
    """Print each iteration's exact lm loss (a float.hex) from the loss_dict Megatron's training_log receives."""
    import inspect

    import megatron.training.training as training

    original = training.training_log
    signature = inspect.signature(original)

    def training_log(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        value = (bound.get("loss_dict") or {}).get("lm loss")
        if value is not None and "iteration" in bound and last_rank():
            loss = float(value.float().sum()) if hasattr(value, "float") else float(value)
            print(f"{LOSS_PROBE} iteration {bound['iteration']} lm loss: {loss.hex()}", flush=True)
            documents = sys.modules.get("mm_adaptor.patches.transformer.document_masks")
            if documents is not None:  # --use-flash-attn's per-document masks: the varlen op's calls so far
                print(f"{LOSS_PROBE} document attention calls: {documents.DOCUMENTS.calls}", flush=True)
        return original(*args, **kwargs)

    training.training_log = training_log


# ---- one variant's run and its log ----

@dataclass
class Run:
    name: str
    label: str
    status: str = "ok"  # ok, failed, skipped
    why: str = ""
    iteration_ms: dict = field(default_factory=dict)
    printed_loss: dict = field(default_factory=dict)
    exact_loss: dict = field(default_factory=dict)
    max_allocated_mb: float | None = None
    log: Path | None = None

    def median_ms(self, warmup: int) -> float | None:
        times = [ms for it, ms in sorted(self.iteration_ms.items()) if it > warmup]
        return statistics.median(times) if times else None

    def losses(self) -> dict:
        return self.exact_loss or self.printed_loss


def parse_line(run: Run, line: str) -> int | None:
    """Record what the line reports; the iteration number when it is Megatron's iteration line."""
    if m := PROBE_LINE.search(line):
        run.exact_loss[int(m.group(1))] = float.fromhex(m.group(2))
    elif m := ITERATION_LINE.search(line):
        iteration = int(m.group(1))
        run.iteration_ms[iteration] = float(m.group(3))
        if loss := LM_LOSS.search(line):
            run.printed_loss[iteration] = float(loss.group(1))
        return iteration
    elif m := MEMORY_LINE.search(line):
        run.max_allocated_mb = max(run.max_allocated_mb or 0.0, float(m.group(1)))
    return None


def parse_log(run: Run, text: str) -> Run:
    for line in text.splitlines():
        parse_line(run, line)
    return run


def run_variant(name: str, command: list[str], env: dict, workdir: Path, train_iters: int, timeout: float) -> Run:
    label = VARIANTS[name][0]
    run = Run(name, label, log=workdir / f"{name}.log")
    errors = deque(maxlen=12)  # torchrun's own summary fills the last lines; the cause is earlier
    print(f"[e2e] {label}: starting (command and output in {run.log})", flush=True)
    with open(run.log, "w") as log:
        log.write(shlex.join(command) + "\n")
        log.flush()
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
        timed_out = threading.Event()
        timer = threading.Timer(timeout, lambda: (timed_out.set(), _stop(proc)))
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                if ERROR_LINE.search(line) and "torch/distributed/elastic" not in line:
                    errors.append(line.rstrip())
                iteration = parse_line(run, line)
                if iteration is not None and (iteration == 1 or iteration % 5 == 0 or iteration == train_iters):
                    loss = run.printed_loss.get(iteration)
                    print(f"[e2e]   {label}: iteration {iteration}/{train_iters}, "
                          f"{run.iteration_ms[iteration]:.1f} ms, lm loss {loss}", flush=True)
            returncode = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                _stop(proc)
    if returncode != 0 or len(run.iteration_ms) < train_iters:
        run.status = "failed"
        run.why = (f"timed out after {timeout:.0f} s" if timed_out.is_set() else f"exit status {returncode}"
                   if returncode else f"logged {len(run.iteration_ms)} of {train_iters} iterations")
        print(f"[e2e] {label} FAILED ({run.why}); the last error lines of {run.log}:", *errors, sep="\n  ",
              flush=True)
    return run


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---- the command lines ----

def megatron_arguments(opts) -> list[str]:
    seq, iters = opts.seq_length, opts.train_iters
    args = ["--num-layers", opts.num_layers, "--hidden-size", opts.hidden_size,
            "--num-attention-heads", opts.num_attention_heads, "--seq-length", seq, "--max-position-embeddings", seq,
            "--micro-batch-size", opts.micro_batch_size, "--global-batch-size", opts.micro_batch_size,
            "--train-iters", iters, "--lr", "1e-4", "--seed", "1234",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", opts.vocab_size,
            "--eval-iters", 0, "--eval-interval", iters + 1, "--log-interval", 1, "--log-memory-interval", iters,
            "--transformer-impl", "local", "--normalization", "RMSNorm", "--swiglu",
            "--position-embedding-type", "rope", "--disable-bias-linear",
            "--attention-dropout", 0, "--hidden-dropout", 0, *BASELINE_FLAGS]
    if opts.device == "cpu":
        args += ["--distributed-backend", "gloo"]
    elif not opts.fp32:
        args += ["--bf16"]
    return [str(a) for a in args] + opts.extra


def variant_command(name: str, opts) -> list[str]:
    _, with_adaptor, flags = VARIANTS[name]
    return [opts.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(opts.nproc_per_node),
            os.path.abspath(__file__), "--worker", "adaptor" if with_adaptor else "plain",
            str(Path(opts.megatron_lm) / "pretrain_gpt.py"), *megatron_arguments(opts), *flags]


# ---- the table ----

def max_relative_difference(losses: dict, reference: dict) -> float | None:
    common = sorted(set(losses) & set(reference))
    if not common:
        return None
    return max(abs(losses[i] - reference[i]) / max(abs(reference[i]), 1e-30) for i in common)


def identity_verdict(runs: dict) -> str | None:
    """None when the import without flags printed the unpatched losses bit for bit (or one of them did not run)."""
    plain, imported = runs.get("unpatched"), runs.get("import")
    if not (plain and imported and plain.status == imported.status == "ok"):
        return None
    a, b = plain.losses(), imported.losses()
    if a.keys() != b.keys():
        return f"iterations differ: unpatched {sorted(a)}, import {sorted(b)}"
    for it in sorted(a):
        if a[it] != b[it]:
            return f"lm loss at iteration {it}: unpatched {a[it]!r}, import without flags {b[it]!r}"
    return None


def precision(opts) -> str:
    return "bf16" if "--bf16" in opts.extra or (opts.device != "cpu" and not opts.fp32) else "fp32"


def print_table(runs: dict, opts) -> str:
    """Prints the table; returns the reference variant's name."""
    reference_name = "unpatched" if runs.get("unpatched") and runs["unpatched"].status == "ok" else "import"
    reference = runs.get(reference_name)
    ref_ms = reference.median_ms(opts.warmup_iters) if reference and reference.status == "ok" else None
    ref_label = VARIANTS[reference_name][0]
    print(f"\n# Megatron-LM pretrain_gpt.py, {opts.device}: {opts.num_layers} layers, hidden {opts.hidden_size}, "
          f"{opts.num_attention_heads} heads, seq {opts.seq_length}, micro-batch {opts.micro_batch_size}, "
          f"{precision(opts)}, {opts.train_iters} iterations "
          f"(ms/iter: median after {opts.warmup_iters}); logs in {opts.log_dir}")
    columns = ["variant", "ms/iter", f"speedup vs {ref_label}", "max allocated GiB",
               f"max rel. loss diff vs {ref_label}"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for run in runs.values():
        if run.status != "ok":
            print(f"| {run.label} | {run.status}: {run.why} |  |  |  |")
            continue
        ms = run.median_ms(opts.warmup_iters)
        speedup = f"{ref_ms / ms:.3f}x" if ref_ms and ms else ""
        memory = ("n/a on the CPU" if opts.device == "cpu" else
                  f"{run.max_allocated_mb / 1024:.2f}" if run.max_allocated_mb is not None else "not printed")
        diff = max_relative_difference(run.losses(), reference.losses()) if ref_ms else None
        print(f"| {run.label} | {ms:.1f} | {speedup} | {memory} | "
              f"{'' if diff is None else f'{diff:.2e}'} |", flush=True)
    return reference_name


def parse_options(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout (its pretrain_gpt.py)")
    parser.add_argument("--device", choices=("cuda", "npu", "cpu"), default="cuda",
                        help="npu: torch_npu's device (a real one, or tests/fake_npu on PYTHONPATH), the CUDA sizes")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(DEFAULT_VARIANTS))
    for name, (cuda_default, cpu_default) in MODEL_DEFAULTS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            help=f"default {cuda_default} on CUDA, {cpu_default} on the CPU")
    parser.add_argument("--fp32", action="store_true", help="CUDA: train in fp32 instead of bf16")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs torchrun")
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="ranks per variant (with the layout's flags after --, e.g. "
                             "-- --tensor-model-parallel-size 2)")
    parser.add_argument("--log-dir", help="keep each variant's log here (default: a new temporary directory)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per variant")
    opts = parser.parse_args(argv)
    opts.extra = extra
    for name, defaults in MODEL_DEFAULTS.items():
        if getattr(opts, name) is None:
            setattr(opts, name, defaults[opts.device == "cpu"])
    if opts.train_iters <= opts.warmup_iters:
        parser.error("--train-iters must exceed --warmup-iters")
    if not (Path(opts.megatron_lm) / "pretrain_gpt.py").is_file():
        parser.error(f"no pretrain_gpt.py in {opts.megatron_lm}")
    opts.log_dir = opts.log_dir or tempfile.mkdtemp(prefix="megatron-lm-e2e-")
    Path(opts.log_dir).mkdir(parents=True, exist_ok=True)
    return opts


def main(argv=None) -> int:
    opts = parse_options(argv)
    env = dict(os.environ)
    # as an activated venv: Megatron-LM compiles its dataset helpers with the `python3` on PATH (pybind11 there)
    env["PATH"] = os.pathsep.join([str(Path(opts.python).parent), env.get("PATH", "")])
    if opts.device == "cpu":
        env["MM_ADAPTOR_DEVICE"] = "cpu"
    elif opts.device == "cuda":
        warn_about_cuda_setup()
    runs = {}
    for name in opts.variants:
        if name == "unpatched" and opts.device != "cuda":
            runs[name] = Run(name, VARIANTS[name][0], status="skipped",
                             why="unpatched Megatron-LM requires CUDA (initialize_megatron asserts it)")
            print(f"[e2e] unpatched: skipped on the {opts.device} ({runs[name].why})", flush=True)
            continue
        runs[name] = run_variant(name, variant_command(name, opts), env, Path(opts.log_dir), opts.train_iters,
                                 opts.timeout)
    print_table(runs, opts)
    status = 0
    if verdict := identity_verdict(runs):
        print(f"\nFAIL: the import without flags changed the losses: {verdict}")
        status = 1
    elif runs.get("unpatched") and runs.get("import") and runs["unpatched"].status == runs["import"].status == "ok":
        print(f"\nThe import without flags reproduced the unpatched losses bit for bit "
              f"({len(runs['import'].losses())} iterations).")
    if failed := [run.label for run in runs.values() if run.status == "failed"]:
        print(f"FAIL: {', '.join(failed)} did not finish; see the logs in {opts.log_dir}")
        status = 1
    return status


def warn_about_cuda_setup() -> None:
    import torch
    from torch.utils import cpp_extension

    if not torch.cuda.is_available():
        print("[e2e] warning: torch sees no CUDA device; use --device cpu to run on the CPU", flush=True)
    if cpp_extension.CUDA_HOME is None:
        print("[e2e] warning: no CUDA toolkit found (CUDA_HOME); Megatron-LM's start-up runs $CUDA_HOME/bin/nvcc -V "
              "to load its legacy fused kernels", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        sys.exit(main())
