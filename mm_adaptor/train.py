"""Built-in training driver: a tiny GPT from megatron-core's local spec on mock data, any layout.

`mm-adaptor train [Megatron-LM model/layout flags] [feature flags] [--nproc-per-node N]` launches its
own local ranks (or runs under torchrun) and prints Megatron-style iteration lines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

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
    if args.group_query_attention and args.num_query_groups is None:
        raise LayoutError("--group-query-attention needs --num-query-groups")
    return args


# ---------------------------------------------------------------- data


class MockBatches:
    """Deterministic synthetic token streams with a learnable next-token rule.

    Sample g depends only on (seed, g), so every layout sees the same global batch.
    Each sequence is an arithmetic progression over the first ALPHABET token ids with a per-sample
    start and stride, so the loss falls quickly (unigram) and keeps falling (the stride rule).
    """

    ALPHABET = 128

    def __init__(self, args, dp_rank: int, start_iteration: int = 0):
        import torch

        self.torch = torch
        self.args = args
        self.dp_rank = dp_rank
        self.iteration = start_iteration
        self.microbatch = 0

    def sample(self, global_index: int):
        torch = self.torch
        gen = torch.Generator().manual_seed(self.args.seed * 1_000_003 + global_index)
        vocab = min(self.args.vocab_size, self.ALPHABET)
        start = int(torch.randint(0, vocab, (1,), generator=gen))
        stride = int(torch.randint(1, 8, (1,), generator=gen))
        seq = (start + stride * torch.arange(self.args.seq_length + 1)) % vocab
        return seq

    def __iter__(self):
        return self

    def __next__(self):
        torch = self.torch
        a = self.args
        base = (self.iteration * a.global_batch_size + self.microbatch * a.micro_batch_size * a.data_parallel_size
                + self.dp_rank * a.micro_batch_size)
        seqs = torch.stack([self.sample(base + j) for j in range(a.micro_batch_size)])
        self.microbatch += 1
        if self.microbatch == a.num_microbatches:
            self.microbatch = 0
            self.iteration += 1
        tokens = seqs[:, :-1].contiguous()
        labels = seqs[:, 1:].contiguous()
        position_ids = torch.arange(a.seq_length).unsqueeze(0).expand_as(tokens).contiguous()
        loss_mask = torch.ones_like(tokens, dtype=torch.float)
        return {"tokens": tokens, "labels": labels, "position_ids": position_ids, "loss_mask": loss_mask}


# ---------------------------------------------------------------- model


def transformer_config(args):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32)
    ffn = args.ffn_hidden_size
    if ffn is None:
        ffn = int(args.hidden_size * 8 / 3) if args.swiglu else 4 * args.hidden_size
        ffn = ((ffn + 63) // 64) * 64 if args.swiglu else ffn
    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=ffn,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention or args.num_query_groups else None,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        expert_model_parallel_size=args.expert_model_parallel_size,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        use_cpu_initialization=True,
        perform_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=True,
    )
    if args.num_experts:
        kwargs.update(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size or ffn,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_grouped_gemm=args.moe_grouped_gemm,
            moe_router_dtype="fp32",
        )
    return TransformerConfig(**kwargs)


def build_model(args, config):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
                                    normalization=args.normalization)
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=args.vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            vp_stage=stage,
        ))
    return chunks


def wrap_model(args, config, chunks):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=True,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        module = Float16Module(config, chunk) if (args.bf16 or args.fp16) else chunk
        wrapped.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                               disable_bucketing=i > 0))
    for chunk in wrapped:
        chunk.broadcast_params()
    return wrapped


def build_optimizer(args, config, model):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16, params_dtype=config.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer,
        loss_scale=None, initial_loss_scale=2.0**16 if args.fp16 else None,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    decay_iters = max(1, args.train_iters)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=decay_iters * args.global_batch_size, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=decay_iters * args.global_batch_size,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def loss_func(loss_mask, output_tensor):
    import torch

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


# ---------------------------------------------------------------- the loop


@dataclass
class StepRecord:
    iteration: int
    loss: float | None
    grad_norm: float | None
    elapsed_ms: float
    lr: float
    tokens_per_second: float


@dataclass
class RunState:
    args: argparse.Namespace
    model: list = field(default_factory=list)
    optimizer: object = None
    scheduler: object = None
    iteration: int = 0
    records: list = field(default_factory=list)
    memory: dict = field(default_factory=dict)


def _set_seeds(seed: int) -> None:
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


_SILENT = False


def _print_last_rank(msg: str) -> None:
    import torch.distributed as dist

    if not _SILENT and dist.get_rank() == dist.get_world_size() - 1:
        print(msg, flush=True)


def measured_forward_step(state: RunState):
    """forward_step that records saved-activation bytes per layer during its first call."""
    from mm_adaptor.memory import SavedTensorAccountant

    accountant = SavedTensorAccountant(state.model)

    def step(data_iterator, model):
        if "saved_bytes_per_layer" in state.memory:
            return forward_step(data_iterator, model)
        with accountant.hooks():
            result = forward_step(data_iterator, model)
        state.memory["saved_bytes_per_layer"] = accountant.bytes_per_layer()
        accountant.close()
        return result

    return step


def train_step(state: RunState, data_iterators, forward_backward_func, step_func=forward_step):
    import torch
    from megatron.core import parallel_state as ps

    args = state.args
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    losses = forward_backward_func(
        forward_step_func=step_func,
        data_iterator=data_iterators if len(data_iterators) > 1 else data_iterators[0],
        model=state.model,
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.seq_length,
        forward_only=False,
    )
    update_ok, grad_norm, _ = state.optimizer.step()
    if update_ok:
        state.scheduler.step(increment=args.global_batch_size)
    loss = None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        total = torch.vstack([x["lm loss"].view(-1) for x in losses]).sum(dim=0)
        torch.distributed.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        loss = float(total[0] / total[1])
    return loss, (None if grad_norm is None else float(grad_norm))


def _share_loss_from_last_stage(loss):
    """Every rank learns the step's loss (it lives on the last pipeline stage)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([loss if loss is not None else 0.0, 1.0 if loss is not None else 0.0], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0] / t[1])


def format_iteration(args, rec: StepRecord, consumed: int, loss_scale: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        f" [{stamp}] iteration {rec.iteration:8d}/{args.train_iters:8d}",
        f"consumed samples: {consumed:12d}",
        f"elapsed time per iteration (ms): {rec.elapsed_ms:.1f}",
        f"learning rate: {rec.lr:.6E}",
        f"global batch size: {args.global_batch_size:5d}",
        f"lm loss: {rec.loss:.6E}",
        f"loss scale: {loss_scale:.1f}",
    ]
    if rec.grad_norm is not None:
        parts.append(f"grad norm: {rec.grad_norm:.3f}")
    parts.append(f"tokens per second: {rec.tokens_per_second:.1f}")
    return " | ".join(parts) + " |"


def run_rank(args: argparse.Namespace) -> None:
    """One rank's whole job: backend, features, process groups, model, loop, checkpoint, dump."""
    import torch.distributed as dist

    import mm_adaptor
    from mm_adaptor import devices

    global _SILENT
    _SILENT = args.silent
    backend = devices.install()
    mm_adaptor.enable(args)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        dist.init_process_group(backend=backend.dist_backend, rank=rank, world_size=world)
    try:
        _train(args, backend)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        mm_adaptor.disable()


def _train(args, backend) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.pipeline_parallel import get_forward_backward_func

    world = dist.get_world_size()
    finalize_args(args, world)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    init_num_microbatches_calculator(dist.get_rank(), None, args.global_batch_size, args.micro_batch_size,
                                     args.data_parallel_size)
    _set_seeds(args.seed)
    config = transformer_config(args)
    state = RunState(args=args)
    state.model = wrap_model(args, config, build_model(args, config))
    state.optimizer, state.scheduler = build_optimizer(args, config, state.model)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = state.optimizer.scale_loss
    if args.overlap_grad_reduce:
        config.no_sync_func = [c.no_sync for c in state.model]
        config.grad_sync_func = [c.start_grad_sync for c in state.model]
        if len(state.model) == 1:
            config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]
    if args.overlap_param_gather:
        config.param_sync_func = [c.start_param_sync for c in state.model]
        if len(state.model) == 1:
            config.param_sync_func = config.param_sync_func[0]

    if args.load:
        from mm_adaptor.checkpoint import load_checkpoint

        state.iteration = load_checkpoint(state, args.load, load_optim=not args.no_load_optim)
        _print_last_rank(f" loaded checkpoint from {args.load} at iteration {state.iteration}")

    dp_rank = ps.get_data_parallel_rank()
    data = [MockBatches(args, dp_rank, state.iteration) for _ in state.model]
    fb = get_forward_backward_func()
    tokens_per_step = args.global_batch_size * args.seq_length
    layout = describe_layout(args)
    if not args.quiet:
        _print_last_rank(f" mm-adaptor train: {layout} | device backend: {backend.describe()} | "
                         f"features: {', '.join(applied_feature_names()) or 'none'}")
    start_iteration = state.iteration
    while state.iteration < args.train_iters:
        dist.barrier()
        t0 = time.perf_counter()
        measure = args.dump is not None and state.iteration == start_iteration
        loss, grad_norm = train_step(state, data, fb, measured_forward_step(state) if measure else forward_step)
        elapsed = time.perf_counter() - t0
        state.iteration += 1
        loss = _share_loss_from_last_stage(loss)
        rec = StepRecord(state.iteration, loss, grad_norm, elapsed * 1000, state.optimizer.param_groups[0]["lr"],
                         tokens_per_step / elapsed)
        state.records.append(rec)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at iteration {state.iteration}")
        if not args.quiet and state.iteration % args.log_interval == 0:
            _print_last_rank(format_iteration(args, rec, state.iteration * args.global_batch_size,
                                              state.optimizer.get_loss_scale().item()))
        if args.save and args.save_interval and state.iteration % args.save_interval == 0:
            _save(state, args)
    if args.save and (not args.save_interval or state.iteration % args.save_interval != 0):
        _save(state, args)
    if args.dump:
        write_dump(state, args.dump)
    _print_last_rank(summary(args, state.records, start_iteration, layout))


def applied_feature_names() -> list[str]:
    import mm_adaptor

    return list(mm_adaptor.applied())


def _save(state, args):
    from mm_adaptor.checkpoint import save_checkpoint

    save_checkpoint(state, args.save)
    _print_last_rank(f" saved checkpoint to {args.save} at iteration {state.iteration}")


def describe_layout(args) -> str:
    parts = [f"TP{args.tensor_model_parallel_size}", f"PP{args.pipeline_model_parallel_size}"]
    if args.virtual_pipeline_model_parallel_size:
        parts.append(f"VPP{args.virtual_pipeline_model_parallel_size}")
    parts.append(f"DP{args.data_parallel_size}")
    if args.num_experts:
        parts.append(f"EP{args.expert_model_parallel_size}({args.num_experts} experts)")
    if args.sequence_parallel:
        parts.append("SP")
    if args.use_distributed_optimizer:
        parts.append("dist-opt")
    parts.append("bf16" if args.bf16 else "fp16" if args.fp16 else "fp32")
    return "+".join(parts)


def summary(args, records: list[StepRecord], start_iteration: int, layout: str) -> str:
    if not records:
        return f" training summary: nothing to do (already at iteration {start_iteration} of {args.train_iters})"
    steady = records[1:] or records
    mean_ms = sum(r.elapsed_ms for r in steady) / len(steady)
    tps = sum(r.tokens_per_second for r in steady) / len(steady)
    return (f" training summary: {layout} | iterations {start_iteration + 1}-{records[-1].iteration} | "
            f"lm loss {records[0].loss:.4f} -> {records[-1].loss:.4f} | "
            f"mean iteration {mean_ms:.1f} ms (excluding the first) | tokens per second {tps:.1f}")


def _dump_entries(chunk):
    """(name, parameter, view) per parameter; GroupedMLP's fused expert matrices are split into SequentialMLP's
    per-expert weights and names, so the two expert implementations compare tensor by tensor."""
    from megatron.core.transformer.moe.experts import GroupedMLP

    def fc_views(n, h):
        fc1 = [lambda t, e=e: t.view(n, h, -1)[e].t() for e in range(n)]  # [hidden, E*2f] -> [2f, hidden]
        fc2 = [lambda t, e=e: t.view(n, -1, h)[e].t() for e in range(n)]  # [E*f, hidden] -> [hidden, f]
        return fc1, fc2

    split = {}
    for prefix, module in chunk.named_modules():
        if isinstance(module, GroupedMLP):
            dot = f"{prefix}." if prefix else ""
            fc1, fc2 = fc_views(module.num_local_experts, module.config.hidden_size)
            split[f"{dot}weight1"] = [(f"{dot}local_experts.{e}.linear_fc1.weight", v) for e, v in enumerate(fc1)]
            split[f"{dot}weight2"] = [(f"{dot}local_experts.{e}.linear_fc2.weight", v) for e, v in enumerate(fc2)]
    for name, p in chunk.named_parameters():
        for split_name, view in split.get(name, [(name, lambda t: t)]):
            yield split_name, p, view


def write_dump(state: RunState, directory: str) -> None:
    """Per-rank losses, final main gradients and parameters, keyed by chunk and parameter name."""
    import torch
    import torch.distributed as dist

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    grads, params = {}, {}
    for i, chunk in enumerate(state.model):
        for name, p, view in _dump_entries(chunk):
            key = f"chunk{i}.{name}"
            params[key] = view(p.detach()).float().clone()
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is not None:
                grads[key] = view(g.detach()).float().clone()
    from mm_adaptor.memory import optimizer_state_bytes, parameter_bytes

    memory = dict(state.memory, parameter_bytes=parameter_bytes(state.model),
                  optimizer_state_bytes=optimizer_state_bytes(state.optimizer, state.model))
    rank = dist.get_rank()
    torch.save({"losses": [r.loss for r in state.records], "grad_norms": [r.grad_norm for r in state.records],
                "grads": grads, "params": params, "memory": memory,
                "features": applied_feature_names()}, path / f"rank{rank}.pt")
    if rank == 0:
        (path / "args.json").write_text(json.dumps({k: v for k, v in vars(state.args).items()
                                                    if isinstance(v, (int, float, str, bool, type(None)))},
                                                   indent=1))


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from mm_adaptor.launcher import LaunchError, launch, under_launcher
    from mm_adaptor.features import FeatureConfigError

    try:
        world = int(os.environ["WORLD_SIZE"]) if under_launcher() else args.nproc_per_node
        finalize_args(argparse.Namespace(**vars(args)), world)
        from mm_adaptor import features

        features.validate(features.fill_defaults(args), features.enabled_features(args))
    except (LayoutError, FeatureConfigError) as exc:
        parser.error(str(exc))
    if under_launcher():
        run_rank(args)
        return 0
    try:
        launch(run_rank, (args,), nproc=args.nproc_per_node, timeout=args.timeout)
    except LaunchError as exc:
        print(f"mm-adaptor train: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
