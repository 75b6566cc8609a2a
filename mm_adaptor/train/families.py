"""The driver's hooks per model family (mm_adaptor.models.registry names them): the model's shape as driver
arguments, the family's parallel constraints, the model built for this rank, its batches and its forward step.
Used by the trainer (mm_adaptor.train) and by the harness's runner alike.

`of(args)` looks the family up once per process and argument set: `--model NAME[-tiny]`, and for the default
`gpt` a --hybrid-layer-pattern picks the HybridModel."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from mm_adaptor.models import registry


def model_home(args) -> str | None:
    """The checkpoint directory whose hf/ (config, tokenizer, processor files) describes the model: LoRA's
    --load-base-model, else --load."""
    return getattr(args, "load_base_model", None) or getattr(args, "load", None)


def family_name(args) -> str:
    """--model's value; for the default (gpt): hybrid with a pattern, the converted --load's own family."""
    model = getattr(args, "model", "gpt")
    if model != "gpt":
        return model
    if getattr(args, "hybrid_layer_pattern", None) is not None:
        return "hybrid"
    load = model_home(args)
    if load and (Path(load) / "hf" / "config.json").is_file():
        args.model = registry.spec_for_directory(load).name  # ValueError names an unknown model_type
        return args.model
    return model


def of(args):
    """The driver hooks of the run's family."""
    return _hooks(family_name(args))


_HOOKS: dict[str, object] = {}


def _hooks(model: str):
    if model not in _HOOKS:
        spec, tiny = registry.resolve(model)
        hooks = spec.driver_hooks()
        hooks.model, hooks.tiny = model, tiny
        _HOOKS[model] = hooks
    return _HOOKS[model]


def forward_step(data_iterator, model):
    from mm_adaptor.train.model import loss_func

    batch = next(data_iterator)
    packed = {"packed_seq_params": batch["packed_seq_params"]} if "packed_seq_params" in batch else {}
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                   **packed)
    return output, partial(loss_func, batch["loss_mask"])


class Gpt:
    """Megatron-core's GPT on the local spec, on the driver's mock data; the model flags are the user's."""

    # a --load without the driver's contents file is a converted checkpoint: weights only
    loads_converted_checkpoints = False
    # the family splits pipeline stages itself (a pattern or --pipeline-layers), not --num-layers / PP
    splits_stages = False
    # the batch tensors each context-parallel rank gets its part of (core.sequence_split)
    context_parallel_split = ("tokens", "labels", "loss_mask", "position_ids")

    def __init__(self, spec):
        self.spec = spec
        self.model, self.tiny = spec.name, False

    forward_step = staticmethod(forward_step)

    def problems_before_layout(self, args) -> list[str]:
        """What stops the run before any range or layout rule is read (one line each)."""
        return []

    def shape_args(self, args) -> list[str]:
        """Set the model's shape into the driver's model flags (so the layout rules check it); its problems."""
        return []

    def problems(self, args) -> list[str]:
        """What the family cannot run, after the driver's own layout rules (one line each)."""
        from mm_adaptor.data.packing import problems

        found = problems(args)
        if getattr(args, "encoder_dp_balance", False):
            found.append("--encoder-dp-balance balances a vision encoder's work: it needs a vision-language --model")
        return found

    def data_problems(self, args) -> list[str]:
        return []

    # The tiny GPT's shape and run where nothing else names them (Megatron-LM leaves these unset and refuses to start
    # without them).
    TINY_RUN = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
                    micro_batch_size=2, train_iters=10, lr=1e-3, vocab_size=1024)

    def shape_megatron_args(self, args) -> list[str]:
        """The trainer: Megatron's model arguments left unset get the tiny GPT's (TINY_RUN)."""
        for name, value in self.TINY_RUN.items():
            if getattr(args, name, None) is None and not (name == "train_iters" and args.train_samples):
                setattr(args, name, value)
        if args.make_vocab_size_divisible_by is None:
            args.make_vocab_size_divisible_by = 128
        for name in ("hidden_dropout", "attention_dropout"):
            if getattr(args, name) is None:
                setattr(args, name, 0.1)  # Megatron-LM's default
        return []

    def trainer_problems(self, args) -> list[str]:
        """What the family cannot run under the trainer, once Megatron validated the arguments (one line each)."""
        found = self.problems(args)
        if getattr(args, "packing", False) and not args.calculate_per_token_loss:
            found.append("--packing gives each data-parallel rank its own number of packs, each of its own token "
                         "count: add --calculate-per-token-loss (Megatron's default averages per micro-batch)")
        return found

    def layers_per_stage(self, args) -> int:
        return args.num_layers // args.pipeline_model_parallel_size

    def virtual_stages(self, args) -> int | None:
        raise NotImplementedError  # only families with splits_stages say it

    # the model is built from the caller's TransformerConfig (the runner's, or Megatron's from its arguments)
    builds_from_transformer_config = True

    def chunk(self, args, config, *, pre_process: bool, post_process: bool, vp_stage=None, memory: dict):
        """This rank's model for one (virtual) pipeline stage, on the host."""
        from mm_adaptor.train.model import gpt_chunk

        vocab = getattr(args, "padded_vocab_size", None) or args.vocab_size  # Megatron pads; the runner does not
        return gpt_chunk(args, config, vocab_size=vocab, pre_process=pre_process, post_process=post_process,
                         vp_stage=vp_stage)

    def batches(self, args, dp_rank: int, start_iteration: int, device, chunks) -> list:
        from mm_adaptor.train.data import MockBatches

        if getattr(args, "packing", False):
            from mm_adaptor.data.packing import PackedBatches, text_sample

            mock = MockBatches(args, dp_rank, start_iteration, device)
            return [PackedBatches(args, dp_rank, start_iteration, device, lambda g: text_sample(mock.sample(g)))
                    for _ in chunks]
        return [MockBatches(args, dp_rank, start_iteration, device) for _ in chunks]

    def banner(self, args) -> str:
        packed = getattr(args, "packing", False)
        return " | --packing: each step's samples packed into rows of --seq-length" if packed else ""

    def save_side_files(self, args) -> None:
        pass


class Hybrid(Gpt):
    """Megatron-core's HybridModel from --hybrid-layer-pattern (0.18 and newer)."""

    splits_stages = True  # the pattern's '|' segments are the (virtual) pipeline stages

    def problems_before_layout(self, args) -> list[str]:
        from mm_adaptor.train import hybrid

        return [] if hybrid.available() else [hybrid.unavailable()]

    def shape_args(self, args) -> list[str]:
        from mm_adaptor.train import hybrid

        return hybrid.problems(args)  # the pattern sets --num-layers

    def shape_megatron_args(self, args) -> list[str]:
        return super().shape_megatron_args(args) + self.shape_args(args)

    def layers_per_stage(self, args) -> int:
        from mm_adaptor.train import hybrid

        return hybrid.layers_per_stage(args)

    def virtual_stages(self, args) -> int | None:
        from mm_adaptor.train import hybrid

        return hybrid.virtual_stages(args)

    def chunk(self, args, config, *, pre_process: bool, post_process: bool, vp_stage=None, memory: dict):
        from mm_adaptor.train import hybrid

        built = super().chunk(args, config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                              memory=memory)
        memory.setdefault("hybrid_layer_kinds", {}).update(hybrid.layer_kinds([built]))  # what was built, read back
        return built

    def banner(self, args) -> str:
        return f" | HybridModel {args.hybrid_layer_pattern!r}"
