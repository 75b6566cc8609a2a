"""The driver's layout rules, before any rank starts: out-of-range values (range_problems), then what the layout
implies (data-parallel size, virtual stages, batches) and every rule it breaks, in groups that each return their
problems, one line each (finalize_args raises them together as one LayoutError). Imports neither torch nor megatron."""

from __future__ import annotations

import argparse
import math

from mm_adaptor.core import features
from mm_adaptor.train import families
from mm_adaptor.train.model import ffn_hidden_size


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
    try:
        family = families.of(args)
    except ValueError as exc:
        raise LayoutError(str(exc)) from None
    problems = family.problems_before_layout(args)
    if problems:
        raise LayoutError(*problems)
    problems = range_problems(args) + family.shape_args(args)
    if problems:
        raise LayoutError(*problems)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    # a feature that is Megatron's own arguments with other values (e.g. --moe-tp-extend-ep) sets them here, once
    features.express_in_megatron_arguments(args, features.serving(args, features.enabled_features(args)))
    problems = (_precision_problems(args) + _parallel_layout(args, world_size, family) + _attention_problems(args)
                + _width_problems(args) + _expert_problems(args, world_size) + _batches(args)
                + _optimizer_and_recompute_problems(args, family))
    if not problems:
        problems = family.problems(args)
    if problems:
        raise LayoutError(*problems)
    return args


# Each group below returns its problems, one line each; _parallel_layout and _batches also derive what the layout
# implies (data-parallel size, virtual stages, global batch, micro-batches).

def _precision_problems(args) -> list[str]:
    return ["--bf16 and --fp16 are exclusive: pick one"] if args.bf16 and args.fp16 else []


def _parallel_layout(args, world_size: int, family) -> list[str]:
    """args.data_parallel_size and args.virtual_pipeline_model_parallel_size (None where the layout is broken)."""
    problems = []
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = getattr(args, "context_parallel_size", 1)
    args.data_parallel_size = None
    if world_size % (tp * pp * cp) != 0:
        context = f" x --context-parallel-size {cp}" if cp > 1 else ""
        problems.append(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}{context}: change --nproc-per-node or the layout"
        )
    else:
        args.data_parallel_size = world_size // (tp * pp * cp)
    if args.sequence_parallel and tp == 1:
        problems.append("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.num_layers % pp != 0 and not getattr(args, "pipeline_layers", None) and not family.splits_stages:
        problems.append(_not_divisible("--num-layers", args.num_layers, "--pipeline-model-parallel-size", pp))
    args.virtual_pipeline_model_parallel_size = None
    per_stage = family.layers_per_stage(args)
    if family.splits_stages:  # e.g. a hybrid pattern's '|' segments, which the family's problems checked
        args.virtual_pipeline_model_parallel_size = family.virtual_stages(args)
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
    return problems


def _attention_problems(args) -> list[str]:
    problems = []
    tp = args.tensor_model_parallel_size
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
    return problems


def _width_problems(args) -> list[str]:
    """What tensor (and sequence) parallelism splits must divide evenly."""
    problems = []
    tp = args.tensor_model_parallel_size
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
    return problems


def _expert_problems(args, world_size: int) -> list[str]:
    problems = []
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    etp = getattr(args, "expert_tensor_parallel_size", None)
    if args.num_experts is None:
        if ep > 1:
            problems.append("--expert-model-parallel-size > 1 needs --num-experts")
        if etp is not None:
            problems.append("--expert-tensor-parallel-size needs --num-experts")
        if args.moe_ffn_hidden_size is not None:
            problems.append("--moe-ffn-hidden-size needs --num-experts")
        return problems
    if args.num_experts % ep != 0:
        problems.append(_not_divisible("--num-experts", args.num_experts, "--expert-model-parallel-size", ep))
    if etp is not None and etp < 1:
        problems.append(f"--expert-tensor-parallel-size {etp}: must be at least 1")
        return problems
    given = etp is not None
    etp = etp or tp  # megatron's expert tensor-parallel size defaults to the tensor-parallel size
    expert_ranks = etp * ep * pp
    if (ep > 1 or etp != tp) and world_size % expert_ranks != 0:
        needed = math.lcm(tp * pp, expert_ranks)
        rewritten = getattr(args, features.USERS_ARGUMENTS, None) or {}
        if rewritten:  # a feature set them (e.g. --moe-tp-extend-ep): name megatron's sizes, not flags never typed
            size, experts = f"megatron's expert tensor-parallel size {etp}", f"expert-parallel size {ep}"
        else:
            size = (f"--expert-tensor-parallel-size {etp}" if given else
                    f"expert tensor-parallel size {etp} (megatron's default: --tensor-model-parallel-size)")
            experts = f"--expert-model-parallel-size {ep}"
        problems.append(
            f"world size {world_size} is not divisible by {size} x {experts} x "
            f"--pipeline-model-parallel-size {pp} = {expert_ranks}: use a multiple of {needed} ranks "
            "(--nproc-per-node) or a smaller --expert-model-parallel-size")
    if etp > 1 and not args.disable_bias_linear:
        problems.append("MoE with --tensor-model-parallel-size > 1 (experts split the same way) needs "
                        "--disable-bias-linear: megatron supports expert biases only without expert tensor "
                        "parallelism")
    if tp > 1 and not args.sequence_parallel:
        problems.append("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel: megatron-core "
                        "refuses to train MoE layers under tensor parallelism without it")
    if args.moe_ffn_hidden_size is not None and args.moe_ffn_hidden_size % etp != 0:
        problems.append(_not_divisible("--moe-ffn-hidden-size", args.moe_ffn_hidden_size,
                                       "--expert-tensor-parallel-size" if given else "--tensor-model-parallel-size",
                                       etp))
    return problems


def _batches(args) -> list[str]:
    """args.global_batch_size's default and args.num_microbatches, once the data-parallel size is known."""
    dp, pp = args.data_parallel_size, args.pipeline_model_parallel_size
    if dp is None:
        return []
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp * 2
    step = args.micro_batch_size * dp
    if args.global_batch_size % step != 0:
        return [f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size x "
                f"data-parallel size ({step}): use a multiple of {step}"]
    args.num_microbatches = args.global_batch_size // step
    if args.virtual_pipeline_model_parallel_size and args.num_microbatches % pp != 0:
        return [f"the interleaved schedule needs the number of micro-batches ({args.num_microbatches}) "
                f"to be a multiple of --pipeline-model-parallel-size {pp}: raise --global-batch-size"]
    return []


def _optimizer_and_recompute_problems(args, family) -> list[str]:
    problems = []
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        problems.append("--overlap-param-gather needs --use-distributed-optimizer")
    if args.recompute_granularity == "full" and (args.recompute_method is None or args.recompute_num_layers is None):
        problems.append("--recompute-granularity full needs --recompute-method (uniform or block) and "
                        "--recompute-num-layers")
    if args.recompute_granularity != "full" and (args.recompute_method or args.recompute_num_layers):
        problems.append("--recompute-method and --recompute-num-layers need --recompute-granularity full")
    per_stage = family.layers_per_stage(args)
    if args.recompute_num_layers is not None and args.recompute_num_layers > per_stage:
        problems.append(f"--recompute-num-layers {args.recompute_num_layers} is above the layers per pipeline stage "
                        f"({per_stage}): use 1 to {per_stage}")
    return problems
