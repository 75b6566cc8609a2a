"""The harness runner's arguments: Megatron-LM's names for the model, layout and training flags, plus every
feature's flags; `finalize_args` derives defaults and rejects out-of-range values and impossible layouts, and
`check_paths` the --save / --load / --dump directories, before any rank starts. Imports neither torch nor megatron."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from mm_adaptor.convert.mindspeed_mm import is_mm_checkpoint
from mm_adaptor.core import features
from mm_adaptor.core.one_line_parser import ArgumentParser
from mm_adaptor.ranks.warning_digest import ShowEveryWarning
from mm_adaptor.train import hybrid, vlm
from mm_adaptor.harness.runner.checkpoint_files import MARKER, latest_checkpoint
from mm_adaptor.harness.runner.layout import LayoutError, finalize_args, range_problems  # noqa: F401  (the driver's API)


class RunnerParser(ArgumentParser):
    """The runner's flags; --hf-config is read right after parsing (a refusal is the parser's one line)."""

    def parse_args(self, args=None, namespace=None):
        namespace = super().parse_args(args, namespace)
        try:
            vlm.read_hf_config(namespace)
        except ValueError as exc:
            self.fail(str(exc))
        return namespace


def build_parser(prog: str = "mm-adaptor check") -> argparse.ArgumentParser:
    p = RunnerParser(prog=prog, description="The harness's runs: a tiny GPT (or a family's model) with Megatron-Core "
                                            "and the adaptor's features.")
    m = p.add_argument_group("model (Megatron-LM names)")
    m.add_argument("--num-layers", type=int, default=4)
    m.add_argument("--hidden-size", type=int, default=64)
    m.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden (8/3 x hidden with --swiglu)")
    m.add_argument("--num-attention-heads", type=int, default=4)
    m.add_argument("--num-query-groups", type=int, default=None, help="grouped-query attention (default: no GQA)")
    m.add_argument("--group-query-attention", action="store_true")
    m.add_argument("--seq-length", type=int, default=64)
    m.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    m.add_argument("--vocab-size", type=int, default=1024)
    m.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    m.add_argument("--norm-epsilon", type=float, default=1e-5)
    m.add_argument("--swiglu", action="store_true")
    m.add_argument("--disable-bias-linear", action="store_true")
    m.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    m.add_argument("--rotary-percent", type=float, default=1.0)
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    m.add_argument("--hidden-dropout", type=float, default=0.0)
    m.add_argument("--attention-dropout", type=float, default=0.0)
    m.add_argument("--init-method-std", type=float, default=0.02)
    m.add_argument("--num-experts", type=int, default=None)
    m.add_argument("--moe-router-topk", type=int, default=2)
    m.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    m.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    m.add_argument("--moe-token-dispatcher-type", choices=["alltoall", "allgather"], default="alltoall")
    m.add_argument("--moe-grouped-gemm", action="store_true")
    m.add_argument(hybrid.FLAG, type=str, default=None, metavar="PATTERN",
                   help="build megatron-core's HybridModel (0.18 and newer) instead of the GPT: one symbol per layer, "
                        "'*' attention, '-' MLP, 'E' MoE, '|' between pipeline segments (more segments than "
                        "pipeline stages: virtual stages), e.g. '*-*-'; sets --num-layers. A pattern starting "
                        "with '-' is given as --hybrid-layer-pattern=-*-*")

    lay = p.add_argument_group("parallel layout (Megatron-LM names)")
    lay.add_argument("--tensor-model-parallel-size", type=int, default=1)
    lay.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    lay.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    lay.add_argument("--sequence-parallel", action="store_true")
    lay.add_argument("--expert-model-parallel-size", type=int, default=1)
    lay.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                     help="tensor-parallel size of the experts (megatron's; default: --tensor-model-parallel-size)")
    lay.add_argument("--use-distributed-optimizer", action="store_true")
    lay.add_argument("--overlap-grad-reduce", action="store_true")
    lay.add_argument("--overlap-param-gather", action="store_true")
    lay.add_argument("--nproc-per-node", type=int, default=2, help="local ranks to launch (ignored under torchrun)")

    t = p.add_argument_group("training (Megatron-LM names)")
    t.add_argument("--micro-batch-size", type=int, default=2)
    t.add_argument("--global-batch-size", type=int, default=None, help="default: micro-batch x data-parallel size x 2")
    t.add_argument("--train-iters", type=int, default=10,
                   help="iteration to train up to, counted from 0 (0 with --save saves the initialised model)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--lr-warmup-iters", type=int, default=0)
    t.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="constant")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="Megatron's activation recomputation: whole layers (full) or core attention (selective)")
    t.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    t.add_argument("--recompute-num-layers", type=int, default=None)
    t.add_argument("--gradient-accumulation-fusion", action="store_true",
                   help="accumulate weight gradients straight into main_grad in the GEMM (Megatron's flag)")
    t.add_argument("--bf16", action="store_true")
    t.add_argument("--fp16", action="store_true")
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--packing", action="store_true",
                   help="pack each step's samples (per data-parallel rank) into micro-batches of at most --seq-length "
                        "tokens, first-fit decreasing, positions restarted per sample, attention kept within each "
                        "sample (PackedSeqParams through mm_adaptor.ops.varlen_attention); needs --micro-batch-size 1")
    t.add_argument("--mock-lengths", choices=["full", "skewed"], default="full",
                   help="the generated samples (the GPT's mock data; a NAME-tiny's images and text without "
                        "--data-path): all --seq-length tokens (full), or 1/16 of it to all of it, most short "
                        "(skewed: padded to --seq-length with the loss masked, unless --packing)")
    t.add_argument("--reset-attention-mask", action="store_true",
                   help="the GPT's mock data as Megatron-LM's documents: each row holds generated documents of skewed "
                        "lengths, each ended by an EOD token (id --vocab-size - 1), and Megatron-LM's per-document "
                        "attention mask (built by megatron.core's GPT data set)")
    t.add_argument("--reset-position-ids", action="store_true",
                   help="the same documents, with positions restarting after each EOD (Megatron-LM's flag)")
    t.add_argument("--log-interval", type=int, default=1)
    t.add_argument("--save", type=str, default=None, help="checkpoint directory to save into")
    t.add_argument("--save-interval", type=int, default=None, help="default: save once, at the end")
    t.add_argument("--load", type=str, default=None,
                   help="checkpoint directory to resume from (at or past --train-iters: nothing to do, status 0)")
    t.add_argument("--no-load-optim", action="store_true", help="load the checkpoint's weights only")
    t.add_argument("--no-save-optim", action="store_true", help="save the weights without the optimizer state")
    t.add_argument("--no-save-rng", action="store_true", help="save no random-number generator states")
    t.add_argument("--no-load-rng", action="store_true", help="keep this run's seeds instead of the checkpoint's RNG")
    t.add_argument("--dump", type=str, default=None,
                   help="write per-rank losses, final gradients and parameters here (used by mm-adaptor check)")
    t.add_argument("--timeout", type=float, default=900.0,
                   help="seconds without progress before a rank is declared hung")
    t.add_argument("--quiet", action="store_true", help="print only the final summary")
    t.add_argument("--silent", action="store_true", help="print nothing (for harnesses that read --dump)")
    t.add_argument("--verbose", action=ShowEveryWarning, help="print every library warning, the known-harmless ones "
                                                              "included (by default they are counted in one line)")

    vlm.add_arguments(p)
    features.add_arguments(p)
    return p



def checkpoint_iteration(directory: str) -> int:
    """The iteration of the latest checkpoint under `directory` (the driver's and Megatron-LM's layout);
    raises LayoutError naming --load when there is none."""
    root = Path(directory)
    if not root.is_dir():
        raise LayoutError(f"--load {directory}: no such directory: give the --save directory of an earlier run")
    if is_mm_checkpoint(root):  # MindSpeed-MM's torch layout: `release` (0) or an iteration number
        text = (root / MARKER).read_text().strip()
        return 0 if text == "release" else int(text)
    marker = root / MARKER
    try:
        iteration = int(marker.read_text().strip())
    except OSError:
        raise LayoutError(f"--load {directory} holds no checkpoint (no {MARKER}): give the --save "
                          "directory of an earlier run") from None
    except ValueError:
        raise LayoutError(f"--load {directory}: {MARKER} does not hold an iteration number: give the "
                          "--save directory of an earlier run") from None
    if not latest_checkpoint(directory).is_dir():
        raise LayoutError(f"--load {directory}: {MARKER} names iteration {iteration} but "
                          f"iter_{iteration:07d} is missing: restore it or give another checkpoint directory")
    return iteration


def _writable_problem(flag: str, directory: str) -> str | None:
    """None when `directory` can be created and written (it is created, and a probe file written and removed)."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        return f"{flag} {directory} is a file, not a directory: give a directory"
    probe = path / f".mm-adaptor-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return f"{flag} {directory} cannot be written ({exc.strerror or exc}): give a writable directory"
    return None


def check_paths(args: argparse.Namespace) -> None:
    """--load must hold a checkpoint; --save and --dump must be writable (created if missing).

    Resuming from a checkpoint already at or past --train-iters is not an error: like Megatron-LM the run has
    nothing to do and ends with status 0, so a finished job that is submitted again succeeds."""
    problems = []
    if args.load:
        try:
            checkpoint_iteration(args.load)
        except LayoutError as exc:
            problems.extend(exc.problems)
    for flag, directory in (("--save", args.save), ("--dump", getattr(args, "dump", None))):
        problem = directory and _writable_problem(flag, directory)
        if problem:
            problems.append(problem)
    if problems:
        raise LayoutError(*problems)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The driver's arguments from a command line (an error prints one line and exits with status 2)."""
    return build_parser().parse_args(argv)
