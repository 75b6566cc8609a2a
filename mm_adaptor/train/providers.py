"""The trainer's providers for megatron.training.pretrain(): this rank's model of one (virtual) stage, its train /
validation / test data, and the forward step, each the run's family's (mm_adaptor.train.families, vlm)."""

from __future__ import annotations

import argparse
import dataclasses
import functools

# What the family's builders record while building (frozen towers, hybrid layer kinds): the banner reads it.
MEMORY: dict = {}
# Splits as pretrain() asks for them; each draws its samples from its own stream (the seed moved by the index)
SPLITS = ("train", "valid", "test")
SPLIT_SEED_STRIDE = 7919

# TransformerConfig fields a vision-language family takes from Megatron's arguments (its architecture comes from
# its own config): how it trains, not what it is. Not rope fusion: megatron's fused rope has no multimodal (mrope)
# path in the [s, b, h, d] layout, so the families keep their own rope. Not bias-activation fusion: it covers GeLU
# and SwiGLU, and the vision towers' activations are others (gelu tanh, quick GeLU), so every tower keeps its own.
RUNTIME_FIELDS = (
    "calculate_per_token_loss", "deallocate_pipeline_outputs", "batch_p2p_comm", "overlap_p2p_comm",
    "gradient_accumulation_fusion", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "distribute_saved_activations", "init_method_std", "bias_dropout_fusion",
    "masked_softmax_fusion", "persist_layer_norm", "attention_softmax_in_fp32",
)


def _args():
    from megatron.training import get_args

    return get_args()


# The MoE layers' training settings (a family with experts takes them into its MoE language layers alone).
MOE_RUNTIME_FIELDS = (
    "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
    "moe_z_loss_coeff", "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_per_layer_logging",
    "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_token_drop_policy", "moe_permute_fusion",
    "moe_router_dtype", "moe_input_jitter_eps",
)


def moe_runtime_fields(args) -> dict:
    from megatron.training.arguments import core_transformer_config_from_args

    if not args.num_experts:
        return {}
    config = core_transformer_config_from_args(args)
    names = {f.name for f in dataclasses.fields(config)}
    return {name: getattr(config, name) for name in MOE_RUNTIME_FIELDS if name in names}


def runtime_fields(args) -> dict:
    """The training settings of Megatron's arguments as TransformerConfig fields (core_transformer_config_from_args
    of the shaped arguments), for a family that builds its own config."""
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    names = {f.name for f in dataclasses.fields(config)}
    fields = {name: getattr(config, name) for name in RUNTIME_FIELDS if name in names}
    for name in ("hidden_dropout", "attention_dropout"):  # given on the command line: the user's, else the family's
        if getattr(args, f"{name}_given", False):
            fields[name] = getattr(args, name)
    return fields


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None, **_unused):
    """Megatron's model provider: the family's chunk of this stage (the GPT from Megatron's own TransformerConfig of
    the arguments, as pretrain_gpt.py builds it; a vision-language family from its config, with Megatron's training
    settings)."""
    from megatron.training.arguments import core_transformer_config_from_args

    from mm_adaptor.train import families

    args = _args()
    family = families.of(args)
    if family.builds_from_transformer_config:
        transformer_config = config if config is not None else core_transformer_config_from_args(args)
        chunk = family.chunk(args, transformer_config, pre_process=pre_process, post_process=post_process,
                             vp_stage=vp_stage, memory=MEMORY)
    else:
        # the training settings ride on a copy: Megatron pickles its arguments into every checkpoint
        view = argparse.Namespace(**vars(args), transformer_runtime=runtime_fields(args),
                                  moe_runtime=moe_runtime_fields(args))
        chunk = family.chunk(view, None, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                             memory=MEMORY)
    return with_lora(chunk, args)


def with_lora(chunk, args):
    """With --lora-target-modules: the chunk's adapters (mm_adaptor.lora), and what Megatron saves and loads of it
    the adapters alone. What was adapted goes into MEMORY for the banner."""
    from mm_adaptor import lora

    if not lora.enabled(args):
        return chunk
    try:
        done = lora.apply(chunk, lora.settings_from_args(args), require_every_target=False)
    except ValueError as exc:  # a target the built model cannot take: one line from the launcher
        from mm_adaptor.train.arguments import UsageError

        raise UsageError(str(exc)) from None
    record = MEMORY.setdefault("lora", {"targets_hit": set(), "modules": 0})
    record["targets_hit"].update(done["lora_targets_hit"])
    record["modules"] += len(done["lora_modules"])
    lora.adapters_only(chunk)  # the base loads once the model is built and placed (engine._built)
    return chunk


def _split_args(args, split: str) -> argparse.Namespace:
    """The arguments a split's batches are drawn with: its own seed, and for validation and test the evaluation
    batch size Megatron's evaluate() reads."""
    index = SPLITS.index(split)
    if index == 0:
        return args
    view = argparse.Namespace(**vars(args))
    view.packing = False  # evaluation reads whole samples, padded: the same per-token loss, fixed micro-batches
    view.seed = args.seed + SPLIT_SEED_STRIDE * index
    view.global_batch_size = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    view.micro_batch_size = getattr(args, "eval_micro_batch_size", None) or args.micro_batch_size
    return view


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's datasets provider under --dataloader-type external: an endless iterator of this rank's
    micro-batches per split, from the consumed samples of a resumed run on (the family's batches; the validation
    and test splits drawn apart from the training samples)."""
    from megatron.core import parallel_state as ps

    from mm_adaptor import devices
    from mm_adaptor.train import families

    args = _args()
    family = families.of(args)
    device = devices.current().torch_device()
    # the training stream from where the data began (--restart-data: the iteration it restarted at)
    consumed = {"train": args.consumed_train_samples - (getattr(args, "data_first_sample", 0) or 0),
                "valid": args.consumed_valid_samples, "test": 0}
    iterators = []
    for split, wanted in zip(SPLITS, train_val_test_num_samples):
        if not wanted and split != "train":
            iterators.append(None)
            continue
        view = _split_args(args, split)
        view.data_parallel_size = ps.get_data_parallel_world_size()
        view.num_microbatches = view.global_batch_size // (view.micro_batch_size * view.data_parallel_size)
        view.data_split = split
        view.decode_pixels = ps.is_pipeline_first_stage(ignore_virtual=True)  # the stage whose model takes pixels
        start_iteration = consumed[split] // view.global_batch_size
        batches = _source(family, view, start_iteration, device)
        if batches is None:  # the split has no samples
            iterators.append(None)
            continue
        group = _broadcast_group(family, view)
        reads = group is None or ps.get_tensor_model_parallel_rank() == 0
        if split == "train" and args.num_workers > 0 and reads:  # made in loader workers (on the host), in order
            from mm_adaptor.train.loader import WorkerBatches

            batches = WorkerBatches(functools.partial(_source, family, view, start_iteration, torch_cpu()), device,
                                    args.num_workers, packed=getattr(view, "packing", False),
                                    counts_tokens=hasattr(batches, "tokens_this_step"),
                                    bad_limit=getattr(batches, "bad_limit", 0) or 0)
        if group is not None:
            from mm_adaptor.train.tp_broadcast import TensorParallelBroadcast

            batches = TensorParallelBroadcast(batches, group, ps.get_tensor_model_parallel_src_rank(), device,
                                              packed=getattr(view, "packing", False))
        iterators.append(StepCounted(batches) if split == "train" else batches)
    return tuple(iterators)


def _broadcast_group(family, view):
    """The tensor-parallel group whose first rank reads (and packs) a data set's records for all (tp_broadcast), or
    None: no tensor parallelism, or no records (generated batches cost nothing to make)."""
    from megatron.core import parallel_state as ps

    from mm_adaptor.train import vlm_data

    if ps.get_tensor_model_parallel_world_size() == 1:
        return None
    if not hasattr(family, "model_config") or not vlm_data.records_path(view):
        return None
    return ps.get_tensor_model_parallel_group()


def torch_cpu():
    import torch

    return torch.device("cpu")


def _source(family, view, start_iteration: int, device):
    """This rank's batches of the split `view` names, from `start_iteration` on, on `device` (None: no samples)."""
    from megatron.core import parallel_state as ps

    from mm_adaptor.train.data import ContextParallelSlices

    batches = family.batches(view, ps.get_data_parallel_rank(), start_iteration, device, [None])[0]
    if batches is not None and ps.get_context_parallel_world_size() > 1:
        batches = ContextParallelSlices(batches, ps.get_context_parallel_rank(), ps.get_context_parallel_world_size(),
                                        family.context_parallel_split)
    return batches


datasets_provider.is_distributed = True  # every rank builds its own (the family's batches are rank-aware)


def forward_step(data_iterator, model):
    from mm_adaptor.train import families

    return families.of(_args()).forward_step(data_iterator, model)


class StepCounted:
    """The training batches, with what the step read counted for the log line and the FLOP count (step_log)."""

    def __init__(self, batches):
        self.batches = batches

    def __getattr__(self, name):
        return getattr(self.batches, name)

    def __iter__(self):
        return self

    def start_step(self) -> None:
        from mm_adaptor.train import step_log

        start = getattr(self.batches, "start_step", None)
        if start is not None:
            with step_log.STEP.waiting_for_data():  # packs: the step's samples are read here
                start()

    def __next__(self):
        from mm_adaptor.train import step_log

        with step_log.STEP.waiting_for_data():
            batch = next(self.batches)
        step_log.STEP.count(batch)
        return batch
