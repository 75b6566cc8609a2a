"""`mm-adaptor train` arguments: Megatron-LM's names for the model, layout and training flags, plus every
feature's flags; `finalize_args` derives defaults and rejects out-of-range values and impossible layouts, and
`check_paths` the --save / --load / --dump directories, before any rank starts. Imports neither torch nor megatron."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from mm_adaptor import features
from mm_adaptor.arguments_errors import ArgumentParser
from mm_adaptor.output import ShowEveryWarning
from mm_adaptor.train import hybrid, vlm
from mm_adaptor.train.checkpoint_files import MARKER, latest_checkpoint
from mm_adaptor.train.model import ffn_hidden_size


def build_parser(prog: str = "mm-adaptor train") -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description="Train a tiny GPT with Megatron-Core (and the adaptor's features).")
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


class LayoutError(ValueError):
    """Arguments the driver cannot run: out of range, an impossible layout, or an unusable directory.
    str() has one line per problem, each naming the flag and the fix; `problems` lists them."""

    def __init__(self, *problems: str):
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


# Driver arguments and the values they accept; `not (value >= low)` also refuses NaN.
_AT_LEAST_ONE = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "nproc_per_node", "micro_batch_size", "log_interval")
_AT_LEAST_ONE_WHEN_GIVEN = ("ffn_hidden_size", "num_query_groups", "max_position_embeddings", "num_experts",
                            "moe_ffn_hidden_size", "num_layers_per_virtual_pipeline_stage", "global_batch_size",
                            "save_interval", "recompute_num_layers")
_NOT_NEGATIVE = ("lr", "min_lr", "lr_warmup_iters", "weight_decay", "clip_grad", "init_method_std",
                 "moe_aux_loss_coeff", "adam_eps")
_FROM_ZERO_BELOW_ONE = ("hidden_dropout", "attention_dropout", "adam_beta1", "adam_beta2")
_ABOVE_ZERO = ("norm_epsilon", "timeout")


def range_problems(args: argparse.Namespace) -> list[str]:
    """One line per argument outside the values it accepts."""
    problems = []
    for dest in _AT_LEAST_ONE + _AT_LEAST_ONE_WHEN_GIVEN:
        value = getattr(args, dest)
        if value is not None and not value >= 1:
            problems.append(f"{_flag(dest)} {value}: must be at least 1")
    for dest in _NOT_NEGATIVE:
        if not getattr(args, dest) >= 0:
            problems.append(f"{_flag(dest)} {getattr(args, dest)}: must be 0 or more")
    for dest in _FROM_ZERO_BELOW_ONE:
        if not 0 <= getattr(args, dest) < 1:
            problems.append(f"{_flag(dest)} {getattr(args, dest)}: must be in [0, 1)")
    for dest in _ABOVE_ZERO:
        if not getattr(args, dest) > 0:
            problems.append(f"{_flag(dest)} {getattr(args, dest)}: must be more than 0")
    if not 0 < args.rotary_percent <= 1:
        problems.append(f"--rotary-percent {args.rotary_percent}: must be in (0, 1]")
    if not 0 <= args.seed < 2**32:
        problems.append(f"--seed {args.seed}: must be in [0, 2**32)")
    if args.train_iters < 0 or (args.train_iters == 0 and not args.save and not args.load):
        problems.append(f"--train-iters {args.train_iters}: must be at least 1 (0 only with --save, which then "
                        "saves the initialised model)")
    if 0 <= args.lr < args.min_lr:
        problems.append(f"--min-lr {args.min_lr} is above --lr {args.lr}: lower --min-lr")
    if args.train_iters >= 1 and args.lr_warmup_iters >= args.train_iters:
        problems.append(f"--lr-warmup-iters {args.lr_warmup_iters} must be below --train-iters {args.train_iters} "
                        "(megatron's scheduler requires it)")
    if args.num_experts is not None and not 1 <= args.moe_router_topk <= args.num_experts:
        problems.append(f"--moe-router-topk {args.moe_router_topk}: must be between 1 and --num-experts "
                        f"{args.num_experts}")
    return problems


def _near_multiple(value: int, factor: int) -> int:
    return max(factor, round(value / factor) * factor)


def _not_divisible(flag: str, value: int, by_flag: str, by: int, why: str = "", note: str = "") -> str:
    return (f"{flag} {value}{note} is not divisible by {by_flag} {by}{why}: use a multiple of {by} "
            f"(e.g. {_near_multiple(value, by)})")


def finalize_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Derive defaults; raise LayoutError listing every out-of-range value, or else every broken rule of the
    layout (Megatron-LM's divisibility rules for what the driver builds)."""
    is_hybrid = getattr(args, "hybrid_layer_pattern", None) is not None
    if is_hybrid and not hybrid.available():
        raise LayoutError(hybrid.unavailable())
    problems = range_problems(args) + (vlm.shape_args(args) if vlm.is_vlm(args) else [])
    if problems:
        raise LayoutError(*problems)
    if is_hybrid:
        problems = hybrid.problems(args) or (
            [f"{hybrid.FLAG} builds a language model: it does not combine with the vision-language model's flags"]
            if vlm.is_vlm(args) else [])
        if problems:
            raise LayoutError(*problems)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = args.expert_model_parallel_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.bf16 and args.fp16:
        problems.append("--bf16 and --fp16 are exclusive: pick one")
    args.data_parallel_size = None
    if world_size % (tp * pp) != 0:
        problems.append(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}: change --nproc-per-node or the layout"
        )
    else:
        args.data_parallel_size = world_size // (tp * pp)
    dp = args.data_parallel_size
    if args.sequence_parallel and tp == 1:
        problems.append("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.num_layers % pp != 0 and not getattr(args, "pipeline_layers", None) and not is_hybrid:
        problems.append(_not_divisible("--num-layers", args.num_layers, "--pipeline-model-parallel-size", pp))
    args.virtual_pipeline_model_parallel_size = None
    per_stage = args.num_layers // pp
    if is_hybrid:  # the pattern's '|' segments are the (virtual) pipeline stages; hybrid.problems checked them
        args.virtual_pipeline_model_parallel_size = hybrid.virtual_stages(args)
        per_stage = hybrid.layers_per_stage(args)
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        if pp < 2:
            problems.append("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2")
        elif per_stage % args.num_layers_per_virtual_pipeline_stage != 0:
            problems.append(
                f"layers per pipeline stage ({per_stage}) is not divisible by "
                f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}: use a "
                f"divisor of {per_stage}"
            )
        else:
            args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    if args.hidden_size % args.num_attention_heads != 0:
        problems.append(_not_divisible("--hidden-size", args.hidden_size, "--num-attention-heads",
                                       args.num_attention_heads))
    if args.num_attention_heads % tp != 0:
        problems.append(_not_divisible("--num-attention-heads", args.num_attention_heads,
                                       "--tensor-model-parallel-size", tp))
    if args.group_query_attention and args.num_query_groups is None:
        problems.append("--group-query-attention needs --num-query-groups")
    groups = args.num_query_groups
    if groups is not None:
        if args.num_attention_heads % groups != 0:
            problems.append(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                            f"--num-query-groups {groups}: use a divisor of {args.num_attention_heads}")
        if groups % tp != 0 and tp % groups != 0:
            problems.append(f"--num-query-groups {groups} is neither a multiple nor a divisor of "
                            f"--tensor-model-parallel-size {tp}: change one of them")
    if args.vocab_size % tp != 0:
        problems.append(_not_divisible("--vocab-size", args.vocab_size, "--tensor-model-parallel-size", tp,
                                       " (the driver does not pad the vocabulary as Megatron-LM does)"))
    ffn = ffn_hidden_size(args)
    if ffn % tp != 0:
        default = f" (the default for --hidden-size {args.hidden_size}{' with --swiglu' if args.swiglu else ''})"
        problems.append(_not_divisible("--ffn-hidden-size", ffn, "--tensor-model-parallel-size", tp,
                                       note="" if args.ffn_hidden_size else default))
    if args.sequence_parallel and args.seq_length % tp != 0:
        problems.append(_not_divisible("--seq-length", args.seq_length, "--tensor-model-parallel-size", tp,
                                       " (needed by --sequence-parallel)"))
    if args.max_position_embeddings < args.seq_length:
        problems.append(f"--max-position-embeddings {args.max_position_embeddings} is below --seq-length "
                        f"{args.seq_length}: raise it or leave it out (default: --seq-length)")
    if args.num_experts is None:
        if ep > 1:
            problems.append("--expert-model-parallel-size > 1 needs --num-experts")
        if args.moe_ffn_hidden_size is not None:
            problems.append("--moe-ffn-hidden-size needs --num-experts")
    else:
        if args.num_experts % ep != 0:
            problems.append(_not_divisible("--num-experts", args.num_experts, "--expert-model-parallel-size", ep))
        expert_ranks = tp * ep * pp  # megatron's expert tensor-parallel size defaults to the tensor-parallel size
        if ep > 1 and world_size % expert_ranks != 0:
            needed = math.lcm(tp * pp, expert_ranks)
            problems.append(
                f"world size {world_size} is not divisible by expert tensor-parallel size {tp} (megatron's default: "
                f"--tensor-model-parallel-size) x --expert-model-parallel-size {ep} x --pipeline-model-parallel-size "
                f"{pp} = {expert_ranks}: use a multiple of {needed} ranks (--nproc-per-node) or a smaller "
                "--expert-model-parallel-size")
        if tp > 1 and not args.disable_bias_linear:
            problems.append("MoE with --tensor-model-parallel-size > 1 (experts split the same way) needs "
                            "--disable-bias-linear: megatron supports expert biases only without expert tensor "
                            "parallelism")
        if tp > 1 and not args.sequence_parallel:
            problems.append("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel: megatron-core "
                            "refuses to train MoE layers under tensor parallelism without it")
        if args.moe_ffn_hidden_size is not None and args.moe_ffn_hidden_size % tp != 0:
            problems.append(_not_divisible("--moe-ffn-hidden-size", args.moe_ffn_hidden_size,
                                           "--tensor-model-parallel-size", tp))
    if dp is not None:
        if args.global_batch_size is None:
            args.global_batch_size = args.micro_batch_size * dp * 2
        step = args.micro_batch_size * dp
        if args.global_batch_size % step != 0:
            problems.append(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size x "
                            f"data-parallel size ({step}): use a multiple of {step}")
        else:
            args.num_microbatches = args.global_batch_size // step
            if args.virtual_pipeline_model_parallel_size and args.num_microbatches % pp != 0:
                problems.append(f"the interleaved schedule needs the number of micro-batches ({args.num_microbatches}) "
                                f"to be a multiple of --pipeline-model-parallel-size {pp}: raise --global-batch-size")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        problems.append("--overlap-param-gather needs --use-distributed-optimizer")
    if args.recompute_granularity == "full" and (args.recompute_method is None or args.recompute_num_layers is None):
        problems.append("--recompute-granularity full needs --recompute-method (uniform or block) and "
                        "--recompute-num-layers")
    if args.recompute_granularity != "full" and (args.recompute_method or args.recompute_num_layers):
        problems.append("--recompute-method and --recompute-num-layers need --recompute-granularity full")
    if args.recompute_num_layers is not None and args.recompute_num_layers > per_stage:
        problems.append(f"--recompute-num-layers {args.recompute_num_layers} is above the layers per pipeline stage "
                        f"({per_stage}): use 1 to {per_stage}")
    if not problems and vlm.is_vlm(args):
        problems = vlm.problems(args)
    if problems:
        raise LayoutError(*problems)
    return args


def checkpoint_iteration(directory: str) -> int:
    """The iteration of the latest checkpoint under `directory` (the driver's and Megatron-LM's layout);
    raises LayoutError naming --load when there is none."""
    root = Path(directory)
    if not root.is_dir():
        raise LayoutError(f"--load {directory}: no such directory: give the --save directory of an earlier run")
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
