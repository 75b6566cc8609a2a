"""`mm-adaptor train` arguments: Megatron-LM's names for the model, layout and training flags, plus every
feature's flags; `finalize_args` derives defaults and rejects impossible layouts before any rank starts."""

from __future__ import annotations

import argparse


def build_parser(prog: str = "mm-adaptor train") -> argparse.ArgumentParser:
    from mm_adaptor import features

    p = argparse.ArgumentParser(prog=prog, description="Train a tiny GPT with Megatron-Core (and the adaptor's features).",
                                allow_abbrev=False)
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
    t.add_argument("--train-iters", type=int, default=10)
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
    t.add_argument("--load", type=str, default=None, help="checkpoint directory to resume from")
    t.add_argument("--no-load-optim", action="store_true", help="load the checkpoint's weights only")
    t.add_argument("--dump", type=str, default=None,
                   help="write per-rank losses, final gradients and parameters here (used by mm-adaptor check)")
    t.add_argument("--timeout", type=float, default=900.0, help="seconds before local ranks are declared hung")
    t.add_argument("--quiet", action="store_true", help="print only the final summary")
    t.add_argument("--silent", action="store_true", help="print nothing (for harnesses that read --dump)")

    features.add_arguments(p)
    return p


class LayoutError(ValueError):
    pass


def finalize_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Derive defaults and reject impossible layouts with a message naming the flags."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = args.expert_model_parallel_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.bf16 and args.fp16:
        raise LayoutError("--bf16 and --fp16 are exclusive: pick one")
    if world_size % (tp * pp) != 0:
        raise LayoutError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}: change --nproc-per-node or the layout"
        )
    args.data_parallel_size = world_size // (tp * pp)
    if args.sequence_parallel and tp == 1:
        raise LayoutError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.num_layers % pp != 0:
        raise LayoutError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // pp
        if pp < 2:
            raise LayoutError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2")
        if per_stage % args.num_layers_per_virtual_pipeline_stage != 0:
            raise LayoutError(
                f"layers per pipeline stage ({per_stage}) is not divisible by "
                f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}"
            )
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    if args.num_experts is None and ep > 1:
        raise LayoutError("--expert-model-parallel-size > 1 needs --num-experts")
    if args.num_experts is not None:
        if args.num_experts % ep != 0:
            raise LayoutError(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}")
        if (args.data_parallel_size * tp) % ep != 0:
            raise LayoutError(f"--expert-model-parallel-size {ep} must divide data-parallel x tensor-parallel size "
                              f"({args.data_parallel_size * tp})")
    if args.num_attention_heads % tp != 0:
        raise LayoutError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    if args.vocab_size % tp != 0:
        raise LayoutError(f"--vocab-size {args.vocab_size} is not divisible by --tensor-model-parallel-size {tp}")
    if args.sequence_parallel and args.seq_length % tp != 0:
        raise LayoutError(f"--seq-length {args.seq_length} is not divisible by --tensor-model-parallel-size {tp} "
                          "(needed by --sequence-parallel)")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size * 2
    step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % step != 0:
        raise LayoutError(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size x "
                          f"data-parallel size ({step})")
    args.num_microbatches = args.global_batch_size // step
    if args.virtual_pipeline_model_parallel_size and args.num_microbatches % pp != 0:
        raise LayoutError(f"the interleaved schedule needs the number of micro-batches ({args.num_microbatches}) "
                          f"to be a multiple of --pipeline-model-parallel-size {pp}: raise --global-batch-size")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise LayoutError("--overlap-param-gather needs --use-distributed-optimizer")
    if args.recompute_granularity == "full" and (args.recompute_method is None or args.recompute_num_layers is None):
        raise LayoutError("--recompute-granularity full needs --recompute-method (uniform or block) and "
                          "--recompute-num-layers")
    if args.recompute_granularity != "full" and (args.recompute_method or args.recompute_num_layers):
        raise LayoutError("--recompute-method and --recompute-num-layers need --recompute-granularity full")
    if args.group_query_attention and args.num_query_groups is None:
        raise LayoutError("--group-query-attention needs --num-query-groups")
    return args


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The driver's arguments from a command line (errors exit like any argparse program)."""
    return build_parser().parse_args(argv)
