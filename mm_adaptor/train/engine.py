"""One rank of the trainer: the one-line import (device backend, feature flags, the features applied after
Megatron validates its arguments), then megatron.training.pretrain() with the family's providers.

The trainer's own patch set attaches to Megatron's engine only where it has no way to take what the trainer adds
(each wrapper calls Megatron's function through):
- parse_args: the trainer's preparation of the parsed arguments (arguments.prepare) before Megatron validates them;
- get_model: the banner line, and the routers' hooks of the expert-load spread;
- train_step: the step's counts (tokens, rows, vision FLOPs, expert loads) made global at its end, the step's
  packs announced before it (--packing), progress for the local launcher;
- build_train_valid_test_data_iterators: a split without samples is not evaluated (Megatron would fail on it);
- num_floating_point_operations: a vision-language family's vision FLOPs added (flops.py);
- print_rank_last: the trainer's fields appended to Megatron's iteration line (step_log.py);
- load_checkpoint: MindSpeed-MM's mm-convert layout loaded (weights only);
- save_checkpoint: the family's side files (a vision-language model's hf/ directory) written beside a save;
- _warmup_jit_function: skipped when the run turned off every fusion it compiles;
- ArgumentGroupFactory._get_field_docstrings: read once per class (argument_docs.py)."""

from __future__ import annotations

from mm_adaptor.core import checkpoint_writer
from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet
from mm_adaptor.train import argument_docs

PATCH_SET = "trainer:megatron-training"
TRAINING = "megatron.training.training"


def _contract() -> Contract:
    return Contract(versions=SUPPORTED_MEGATRON_CORE)


def trainer_patch_set(handoff: dict | None = None) -> PatchSet:
    ps = PATCH_SET_CHANGES
    patches = PatchSet(PATCH_SET, changes=ps["changes"], unpatched=ps["unpatched"])
    patches.wrap("megatron.training.arguments.parse_args", _prepared(handoff or {}), contract=_contract())
    patches.wrap(f"{TRAINING}.get_model", _built, contract=_contract())
    patches.wrap(f"{TRAINING}.train_step", _counted_step, contract=_contract())
    patches.wrap(f"{TRAINING}.build_train_valid_test_data_iterators", _no_evaluation_without_samples,
                 contract=_contract())
    patches.wrap(f"{TRAINING}.num_floating_point_operations", _flops, contract=_contract())
    patches.wrap(f"{TRAINING}.print_rank_last", _iteration_fields, contract=_contract())
    patches.wrap("megatron.training.checkpointing.load_checkpoint", _load_mm_checkpoint, contract=_contract())
    patches.wrap("megatron.training.checkpointing.save_checkpoint", _with_side_files, contract=_contract())
    patches.wrap("megatron.training.initialize._warmup_jit_function", _warm_up_what_runs, contract=_contract())
    if argument_docs.factory() is not None:
        patches.wrap(f"{argument_docs.FACTORY}._get_field_docstrings", argument_docs.remembered, contract=_contract())
    return patches


PATCH_SET_CHANGES = dict(
    changes="mm_adaptor's trainer on megatron.training: its arguments prepared before Megatron validates them, "
            "its fields on the iteration line, the vision FLOPs in the throughput, MindSpeed-MM checkpoints loaded",
    unpatched="pretrain() with the trainer's providers, without those additions")


def _prepared(handoff: dict):
    def parse(wrapped, _instance, args, kwargs):
        from mm_adaptor.train import arguments

        parsed = wrapped(*args, **kwargs)
        provider = kwargs.get("extra_args_provider", args[0] if args else None)
        if provider is not arguments.add_arguments:  # another reader of the command line (fault tolerance's)
            return parsed
        parsed = arguments.prepare(parsed)
        if getattr(parsed, "packing", False):  # before the features, so one wrapping attention sees packs reach it
            _apply_packed_attention()
        if "validated_data" in handoff:  # the launching process's validation pass of the data
            from mm_adaptor.train import vlm_data

            vlm_data.receive(handoff["validated_data"])
        # saved with the run's checkpoints (Megatron saves its arguments): what a resumed run checks it reads
        parsed.data_fingerprint, parsed.data_first_sample = handoff.get("data_position", (None, 0))
        return parsed

    return parse


_PACKED_ATTENTION: list = []


def _apply_packed_attention() -> None:
    """--packing: the local spec's core attention takes megatron's PackedSeqParams (kept applied for the rank)."""
    if _PACKED_ATTENTION:
        return
    from mm_adaptor.patches.transformer.packed_attention import patch_set

    patches = patch_set()
    patches.apply()
    _PACKED_ATTENTION.append(patches)


def _built(wrapped, _instance, args, kwargs):
    from megatron.training import get_args, print_rank_0

    from mm_adaptor.api import applied_features
    from mm_adaptor.train import expert_load, families, providers

    model = wrapped(*args, **kwargs)
    megatron_args = get_args()
    chunks = model if isinstance(model, list) else [model]
    if getattr(megatron_args, "load_base_model", None):  # LoRA's base, where Megatron's own load would run
        from mm_adaptor import lora
        from mm_adaptor.core.wrapped import unwrap

        for chunk in chunks:
            lora.load_base(unwrap(chunk), megatron_args.load_base_model)
    expert_load.LOADS.attach(chunks, megatron_args)
    family = families.of(megatron_args)
    frozen = providers.MEMORY.get("frozen_towers")
    params = [param for chunk in chunks for param in chunk.parameters()]
    trainable, total = sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
    print_rank_0(f"> mm_adaptor trainer: {family.model}{family.banner(megatron_args)}; features: "
                 f"{', '.join(applied_features()) or 'none'}" + (f"; frozen: {', '.join(frozen)}" if frozen else "") +
                 f"; trainable {trainable:,} of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%) on "
                 "this rank")
    from mm_adaptor.train.arguments import NOTES

    for note in NOTES:
        print_rank_0(f"> mm_adaptor trainer: {note}")
    if "lora" in providers.MEMORY:
        print_rank_0(f"> mm_adaptor trainer: {_lora_line(providers.MEMORY['lora'], megatron_args)}")
    return model


def _lora_line(record: dict, args) -> str:
    """What LoRA adapted, over every rank's chunks; a target no rank's model has is refused (one line)."""
    import torch.distributed as dist

    from mm_adaptor import lora

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    hit = set().union(*(one["targets_hit"] for one in gathered))
    missing = [target for target in lora.targets_of(args.lora_target_modules) if target not in hit]
    if missing:
        from mm_adaptor.train.arguments import UsageError

        raise UsageError(f"--lora-target-modules {' '.join(missing)}: no module of the model is named so (outside "
                         "frozen towers)")
    return (f"LoRA r {args.lora_r}, alpha {args.lora_alpha:g}: {record['modules']} linears adapted on this rank "
            f"({', '.join(sorted(hit))}), everything else frozen" +
            (f"; base from {args.load_base_model}" if args.load_base_model else "; base randomly initialised"))


def _no_evaluation_without_samples(wrapped, _instance, args, kwargs):
    """Megatron evaluates the validation and test splits whenever --eval-iters is above 0, also where a split has
    no samples (--split 100,0,0, a small data set's 0.1% test share), and then fails on the missing iterator:
    such a split is not evaluated, and a line says so."""
    from megatron.training import get_args, print_rank_0

    iterators = wrapped(*args, **kwargs)
    megatron_args = get_args()
    for name, iterator in zip(("valid", "test"), iterators[1:]):
        empty = iterator is None or (isinstance(iterator, list) and any(i is None for i in iterator))
        flag = f"do_{name}"
        if empty and getattr(megatron_args, flag, False) and megatron_args.eval_iters:
            setattr(megatron_args, flag, False)
            print_rank_0(f"> mm_adaptor trainer: the {'validation' if name == 'valid' else 'test'} split has no "
                         f"samples (--split {megatron_args.split}): it is not evaluated")
    return iterators


def _warm_up_what_runs(wrapped, _instance, args, kwargs):
    """Megatron compiles its bias-activation and bias-dropout-add fusions at start whether or not the run uses
    them (torch.compile: seconds on every rank, minutes on a CPU with a cold cache); when neither is on, nothing."""
    from megatron.training import get_args

    a = get_args()
    activation = a.bias_swiglu_fusion if a.swiglu else a.bias_gelu_fusion  # the one it warms up
    if not (activation or a.bias_dropout_fusion):
        return None
    return wrapped(*args, **kwargs)


def _train_source(data_iterator):
    """The trainer's batch iterator under Megatron's data iterator (the first one with VPP)."""
    iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    return getattr(iterator, "iterable", iterator)


def _counted_step(wrapped, _instance, args, kwargs):
    from megatron.training import get_args

    from mm_adaptor import devices
    from mm_adaptor.ranks.launcher import report_progress
    from mm_adaptor.train import expert_load, step_log

    megatron_args = get_args()
    data_iterator = kwargs.get("data_iterator", args[1] if len(args) > 1 else None)
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    sources = [getattr(it, "iterable", it) for it in iterators if it is not None]
    report_progress("training", megatron_args.curr_iteration + 1)
    step_log.STEP.reset_step()
    for source in sources:
        getattr(source, "start_step", lambda: None)()
    packs = getattr(sources[0], "microbatches_this_step", None) if sources else None
    if packs:  # --packing: this rank's step is as many micro-batches as its samples made packs
        args, kwargs = _with_microbatches(args, kwargs, packs)
    result = wrapped(*args, **kwargs)
    device = devices.current().torch_device()
    step_log.STEP.finish_step(sources[0] if sources else None, megatron_args, device)
    expert_load.LOADS.finish_step(device)
    return result


FORWARD_BACKWARD_INDEX = 6  # train_step(forward_step_func, data_iterator, model, optimizer, scheduler, config, fb)


def _with_microbatches(args, kwargs, count: int):
    """train_step's arguments with its forward_backward_func running `count` micro-batches."""
    original = kwargs.get("forward_backward_func", args[FORWARD_BACKWARD_INDEX] if len(args) > 6 else None)

    def forward_backward(*fb_args, **fb_kwargs):
        fb_kwargs["num_microbatches"] = count
        return original(*fb_args, **fb_kwargs)

    if "forward_backward_func" in kwargs:
        return args, {**kwargs, "forward_backward_func": forward_backward}
    args = list(args)
    args[FORWARD_BACKWARD_INDEX] = forward_backward
    return tuple(args), kwargs


def _flops(wrapped, _instance, args, kwargs):
    """Megatron's num_floating_point_operations(args, batch_size): the language model over the step's rows (its
    samples, or its packs), plus the step's vision FLOPs (step_log.STEP, made global at the step's end)."""
    from mm_adaptor.train.step_log import STEP

    megatron_args, batch_size = (list(args) + [None, None])[:2]
    megatron_args = kwargs.get("args", megatron_args)
    batch_size = kwargs.get("batch_size", batch_size)
    return wrapped(megatron_args, STEP.rows or batch_size) + STEP.vision_flops


def _iteration_fields(wrapped, _instance, args, kwargs):
    from megatron.training import get_args

    from mm_adaptor.train import step_log

    message = kwargs.get("message", args[0] if args else "")
    if isinstance(message, str) and step_log.ITERATION_LINE.search(message):
        message = message + step_log.STEP.line_fields(message, get_args())
        return wrapped(message)
    return wrapped(*args, **kwargs)


def _load_mm_checkpoint(wrapped, _instance, args, kwargs):
    """Megatron's load_checkpoint; a MindSpeed-MM layout under --load (mm-convert's torch files, their module
    names) loads its weights through mm_adaptor.convert.mindspeed_mm, as a fine-tuning start."""
    from megatron.training import get_args

    from mm_adaptor.convert.mindspeed_mm import holds_their_names, is_mm_checkpoint, load_mm_checkpoint

    megatron_args = get_args()
    load_dir = kwargs.get("load_arg") and getattr(megatron_args, kwargs["load_arg"], None) or megatron_args.load
    if not load_dir or not is_mm_checkpoint(load_dir) or not holds_their_names(load_dir):
        return wrapped(*args, **kwargs)  # Megatron's own (a torch-format save of this trainer among them)
    from mm_adaptor.core.wrapped import unwrap

    model, optimizer = (list(args) + [None, None])[:2]
    model = kwargs.get("model", model)
    optimizer = kwargs.get("optimizer", optimizer)
    chunks = model if isinstance(model, list) else [model]
    iteration = load_mm_checkpoint(load_dir, [unwrap(chunk) for chunk in chunks], {})
    if optimizer is not None:
        optimizer.reload_model_params()
    from megatron.training import print_rank_0

    print_rank_0(f"> mm_adaptor trainer: loaded MindSpeed-MM's checkpoint {load_dir} (iteration {iteration}): its "
                 "weights, no optimizer state")
    return (0 if megatron_args.finetune else iteration), 0


def _with_side_files(wrapped, _instance, args, kwargs):
    """Megatron's save_checkpoint, then the family's side files beside it (a vision-language model's hf/: its
    config and tokenizer, which --load and `mm-adaptor convert mcore-to-hf` read)."""
    from megatron.training import get_args

    from mm_adaptor.train import families

    checkpoint_writer.fork_results_server()
    result = wrapped(*args, **kwargs)
    megatron_args = get_args()
    if megatron_args.save:
        families.of(megatron_args).save_side_files(megatron_args)
    return result


def run_rank(argv: list[str], handoff: dict | bytes | None = None) -> None:
    """This rank's whole job: the one-line import, the trainer's patches, pretrain(). `handoff`: the launcher's
    check's findings (pickled where the launcher did not import what they are made of)."""
    if isinstance(handoff, bytes):
        import pickle

        handoff = pickle.loads(handoff)
    import mm_adaptor.megatron_adaptor  # noqa: F401  (the device backend, feature flags and features)
    from mm_adaptor.ranks.process import write_whole_lines
    from mm_adaptor.train import arguments, megatron_training, providers

    write_whole_lines()  # under torchrun too

    patches = trainer_patch_set(handoff)
    patches.apply()
    try:
        megatron_training.pretrain(argv, arguments.PROG, extra_args_provider=arguments.add_arguments,
                                   datasets_provider=providers.datasets_provider,
                                   model_provider=providers.model_provider, forward_step=providers.forward_step)
    finally:
        patches.revert()
