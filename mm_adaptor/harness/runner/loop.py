"""One rank's job: device backend, features, process groups, model, the training loop, checkpoints and the dump."""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from dataclasses import dataclass, field

import mm_adaptor
from mm_adaptor.ranks.launcher import report_progress
from mm_adaptor.train import families
from mm_adaptor.harness.runner.arguments import finalize_args
from mm_adaptor.harness.runner.checkpoint import load_checkpoint, save_checkpoint
from mm_adaptor.train.data import ContextParallelSlices
from mm_adaptor.harness.runner.dump import Recorder
from mm_adaptor.harness.runner.logs import (StepRecord, describe_layout, format_iteration, print_last_rank,
                                            set_silent, summary)
from mm_adaptor.harness.runner.model import (  # noqa: F401  (loss_func: callers read it here too)
    build_model, build_optimizer, connect_grad_sync, loss_func, per_virtual_stage, transformer_config,
    wrap_model)


@dataclass
class RunState:
    args: argparse.Namespace
    model: list = field(default_factory=list)
    optimizer: object = None
    scheduler: object = None
    iteration: int = 0
    records: list = field(default_factory=list)
    memory: dict = field(default_factory=dict)


forward_step = families.forward_step  # the GPT's (callers read it here)


def measured_forward_step(state: RunState, forward_step=forward_step):
    """forward_step that records saved-activation bytes per layer during its first call."""
    from mm_adaptor.devices.memory import SavedTensorAccountant

    accountant = SavedTensorAccountant(state.model)

    def step(data_iterator, model):
        if "saved_bytes_per_layer" in state.memory:
            return forward_step(data_iterator, model)
        with accountant.hooks():
            result = forward_step(data_iterator, model)
        state.memory["saved_bytes_per_layer"] = accountant.bytes_per_layer("device")
        state.memory["host_saved_bytes_per_layer"] = accountant.bytes_per_layer("host")
        state.memory["saved_bytes_per_module"] = accountant.bytes_per_module()
        accountant.close()
        return result

    return step


def _set_seeds(seed: int) -> None:
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def train_step(state: RunState, data_iterators, forward_backward_func, step_func=forward_step, after_backward=None):
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
        num_microbatches=getattr(data_iterators[0], "microbatches_this_step", None) or args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.seq_length,
        forward_only=False,
    )
    if after_backward is not None:
        after_backward()
    update_ok, grad_norm, _ = state.optimizer.step()
    if update_ok:
        state.scheduler.step(increment=args.global_batch_size)
    loss = None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        total = torch.vstack([x["lm loss"].view(-1) for x in losses]).sum(dim=0)
        torch.distributed.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        loss = float(total[0] / total[1])
    return loss, (None if grad_norm is None else float(grad_norm))


def _share_loss_from_last_stage(loss, device):
    """Every rank learns the step's loss, which its pipeline's last stage holds: a float32 broadcast along the
    pipeline (the loss is a float32 value, so nothing rounds; HCCL reduces no float64, and only torch >= 2.7 lets a
    device backend intercept dist.all_reduce)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return loss
    t = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float32, device=device)
    dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return float(t[0])


def run_rank(args: argparse.Namespace) -> None:
    """One rank's whole job: backend, features, process groups, model, loop, checkpoint, dump."""
    import torch.distributed as dist

    from mm_adaptor import devices  # imports torch

    report_progress("building")
    set_silent(args.silent)
    backend = devices.install()
    _packed_attention(args)  # first: a feature wrapping the same attention sees packed calls reach it
    mm_adaptor.enable(args)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend.set_local_device(int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend.dist_backend, rank=rank, world_size=world)
    # The patches stay applied: the rank's process ends after this (ranks.launcher), and reverting them took a
    # tenth of a tiny run's rank.
    try:
        _train(args, backend)
    finally:
        from megatron.core import parallel_state

        report_progress("teardown")
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _packed_attention(args) -> None:
    """--packing: the local spec's core attention takes megatron's PackedSeqParams."""
    if getattr(args, "packing", False):
        from mm_adaptor.patches.transformer.packed_attention import patch_set

        patch_set().apply()


def _build(args, device) -> RunState:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    finalize_args(args, dist.get_world_size())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
    )
    init_num_microbatches_calculator(dist.get_rank(), None, args.global_batch_size, args.micro_batch_size,
                                     args.data_parallel_size)
    _set_seeds(args.seed)
    state = RunState(args=args)
    family = families.of(args)
    config = transformer_config(args) if family.builds_from_transformer_config else None
    chunks = per_virtual_stage(args, device, lambda **stage: family.chunk(args, config, memory=state.memory, **stage))
    config = chunks[0].config
    state.model = wrap_model(args, config, chunks)
    state.optimizer, state.scheduler = build_optimizer(args, config, state.model)
    config.grad_scale_func = state.optimizer.scale_loss
    connect_grad_sync(args, config, state.model)
    if args.load:
        state.iteration = load_checkpoint(state, args.load, load_optim=not args.no_load_optim,
                                          load_rng=not args.no_load_rng)
        print_last_rank(f" loaded checkpoint from {args.load} at iteration {state.iteration}")
    return state


def _train(args, backend) -> None:
    from megatron.core import parallel_state as ps

    from mm_adaptor.devices.memory import peak_bytes
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mm_adaptor.api import applied_features

    device = backend.torch_device()  # where the model, its batches and the collectives' tensors live
    state = _build(args, device)
    recorder = Recorder(state.model) if args.dump else None
    family = families.of(args)
    data = family.batches(args, ps.get_data_parallel_rank(), state.iteration, device, state.model)
    if getattr(args, "context_parallel_size", 1) > 1:  # each context-parallel rank: its two chunks of every batch
        data = [ContextParallelSlices(d, ps.get_context_parallel_rank(), args.context_parallel_size,
                                      family.context_parallel_split) for d in data]
    step_func = family.forward_step
    fb = get_forward_backward_func()
    tokens_per_step = args.global_batch_size * args.seq_length
    layout = describe_layout(args)
    if not args.quiet:
        print_last_rank(f" mm-adaptor train: {layout}{family.banner(args)} | device backend: {backend.describe()} | "
                        f"features: {', '.join(applied_features()) or 'none'}")
        if state.memory.get("frozen_towers"):
            count = state.memory["frozen_elements"]
            where = f"{count} parameters on the last rank" if count else "held by earlier pipeline stages"
            print_last_rank(f" frozen: {', '.join(state.memory['frozen_towers'])} ({where}): no gradient buffer, "
                            "no optimizer state")
    start_iteration = state.iteration
    while state.iteration < args.train_iters:
        report_progress("training", state.iteration + 1)
        backend.barrier()
        t0 = time.perf_counter()
        measure = recorder is not None and state.iteration == start_iteration
        for d in data:
            getattr(d, "start_step", lambda: None)()
        loss, grad_norm = train_step(state, data, fb, measured_forward_step(state, step_func) if measure else step_func,
                                     after_backward=recorder.after_backward if recorder else None)
        elapsed = time.perf_counter() - t0
        state.iteration += 1
        loss = _share_loss_from_last_stage(loss, device)
        rec = StepRecord(state.iteration, loss, grad_norm, elapsed * 1000, state.optimizer.param_groups[0]["lr"],
                         tokens_per_step / elapsed)
        if args.log_tps:
            tokens = _global_tokens(data[0], tokens_per_step, device)
            rec.tokens_per_second, rec.tokens_per_sample = tokens / elapsed, tokens / args.global_batch_size
            rec.samples_per_second = args.global_batch_size / elapsed
        state.records.append(rec)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at iteration {state.iteration}")
        if not args.quiet and state.iteration % args.log_interval == 0:
            print_last_rank(format_iteration(args, rec, state.iteration * args.global_batch_size,
                                             state.optimizer.get_loss_scale().item()))
        if args.save and args.save_interval and state.iteration % args.save_interval == 0:
            _save(state, args)
    if args.save and (not args.save_interval or state.iteration % args.save_interval != 0):
        _save(state, args)
    if getattr(args, "packing", False):
        from mm_adaptor.patches.transformer.packed_attention import CALLS

        state.memory["packed_attention"] = {"calls": CALLS.calls, "last_cu_seqlens": CALLS.last_cu_seqlens}
    state.memory["peak_bytes"] = peak_bytes(device)
    if getattr(args, "reset_attention_mask", False):
        from mm_adaptor.patches.transformer.document_masks import DOCUMENTS

        state.memory["document_attention"] = {"calls": DOCUMENTS.calls, "last_cu_seqlens": DOCUMENTS.last_cu_seqlens}
    if getattr(args, "model", "gpt") != "gpt":
        from mm_adaptor.models.encoder_balance import BALANCE, ENCODER_CLOCK

        state.memory["encoder_seconds"] = list(ENCODER_CLOCK.per_call)
        if getattr(args, "encoder_dp_balance", False):
            state.memory["encoder_balance"] = BALANCE.as_dict()
    if recorder is not None:
        recorder.write(state, args.dump)
    print_last_rank(summary(args, state.records, start_iteration, layout))


def _global_tokens(data, tokens_per_step: int, device) -> int:
    """Non-padding language tokens of the global batch (each rank of a model replica read the same ones)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not hasattr(data, "tokens_this_step"):
        return tokens_per_step
    # an integer count: exact at any size, and every collective library sums int64 (HCCL has no float64)
    t = torch.tensor([int(data.tokens_this_step)], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    replica = ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
    return int(t.item()) // replica


def _save(state, args):
    report_progress("saving", state.iteration)
    save_checkpoint(state, args.save, save_optim=not args.no_save_optim, save_rng=not args.no_save_rng)
    families.of(args).save_side_files(args)
    print_last_rank(f" saved checkpoint to {args.save} at iteration {state.iteration}")
