"""The driver's vision-language families (--model qwen2_5_vl, qwen3_vl, qwen3_vl_moe and their -tiny presets; a
converted --load names its own): the model's shape as driver arguments, its refusals, the model built through the
family's model_provider with frozen towers, its batches and its forward step (the hooks of train/families.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from functools import partial
from pathlib import Path

from mm_adaptor.core.one_line_parser import count
from mm_adaptor.core.wrapped import unwrap
from mm_adaptor.train import families
from mm_adaptor.data import cli as data_cli
from mm_adaptor.models import registry
from mm_adaptor.train import vlm_data
from mm_adaptor.train.families import Gpt
from mm_adaptor.train.model import loss_func


def add_arguments(parser) -> None:
    g = parser.add_argument_group("vision-language models")
    g.add_argument("--model", choices=registry.model_choices(), default="gpt",
                   help="gpt: the tiny GPT (default; a --load holding a converted checkpoint names its own family); "
                        "NAME: the converted checkpoint in --load (its hf/config.json); NAME-tiny: a tiny randomly "
                        "initialised model of that family. " + "; ".join(
                            f"{spec.name}: {spec.summary}" for spec in registry.SPECS.values()))
    g.add_argument("--data-path", default=None,
                   help="JSON/JSONL of messages and images (mm_adaptor.data); default for NAME-tiny: synthetic")
    g.add_argument("--tokenizer-model", default=None,
                   help="HF tokenizer directory (default: --load's hf/, else built-in)")
    g.add_argument("--pipeline-layers", default=None,
                   help="language layers per pipeline stage, e.g. 1,3 (MindSpeed-MM's --llm-pp-layers); default even")
    g.add_argument("--freeze-vision", action="store_true",
                   help="the vision encoder gets no gradient, gradient buffer or optimizer state (fine-tuning)")
    g.add_argument("--freeze-language", action="store_true",
                   help="the same for the language model (with --freeze-vision: train the projector only)")
    g.add_argument("--encoder-dp-balance", action="store_true",
                   help="spread the images of each micro-batch over the data-parallel ranks by patch count for the "
                        "vision encoder, the embeddings returned to their samples' ranks (MindSpeed-MM's name)")
    g.add_argument("--skip-bad-samples", nargs="?", type=count, const=True, default=False, metavar="N",
                   help="train on the good records of --data-path and count the bad ones, instead of refusing them; "
                        "while training, skip up to N samples that fail to load (default N: 100)")
    data_cli.add_preprocessing_arguments(g.add_argument)
    g.add_argument("--hf-config", dest="hf_config_file", default=None, metavar="CONFIG_JSON",
                   help="build the model randomly initialised from this Hugging Face config.json (its family, shapes "
                        "and token ids; no --load), e.g. to measure a full-size model's throughput")
    g.add_argument("--log-tps", action="store_true",
                   help="tokens per sample, non-padding tokens per second and samples per second (MindSpeed-MM)")


def pipeline_layers(args) -> list[int] | None:
    if not args.pipeline_layers:
        return None
    return [int(n) for n in str(args.pipeline_layers).strip("[]").split(",")]


def freeze(model, args) -> dict:
    """requires_grad False on the frozen towers (before DDP: no gradient buffer, no optimizer state)."""
    towers = (["vision_model"] if args.freeze_vision else []) + (["language_model"] if args.freeze_language else [])
    towers += ["vision_projection"] if getattr(args, "freeze_projector", False) else []  # --mm-model's freeze
    frozen = 0
    for name, param in model.named_parameters():
        if name.split(".")[0] in towers:
            param.requires_grad_(False)
            frozen += param.numel()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"frozen_towers": towers, "frozen_elements": frozen, "trainable_elements": trainable}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    vision = {}
    if unwrap(model).pre_process:
        vision = dict(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
        vision.update({name: batch[name] for name in ("pixel_values_videos", "video_grid_thw")
                       if batch.get(name) is not None})  # (a family without videos takes no such keyword)
    if "packed_seq_params" in batch:  # a pack (data.packing): its tokens, and the segments' bounds
        vision["packed_seq_params"] = batch["packed_seq_params"]
        if batch["packed_seq_params"].cu_seqlens_q_padded is not None:  # split over the CP ranks
            # megatron's multimodal rope cuts its frequencies to the CP rank's load-balanced halves of the whole
            # row unless packed_seq_params' cp_group has one rank; whole, the THD rope takes each segment's chunks
            batch["packed_seq_params"].cp_group = _one_rank_group()
    input_ids = batch["input_ids"] if "input_ids" in batch else batch["tokens"]
    output = model(input_ids, batch["position_ids"], None, labels=batch["labels"], **vision)
    return output, partial(loss_func, batch["loss_mask"])


def encoder_balance_problems(args, family: str) -> list[str]:
    if family != "qwen2_5_vl":
        return [f"--encoder-dp-balance is built for Qwen2.5-VL so far (not {family}'s encoder extras or tiles): "
                "drop it"]
    if getattr(args, "packing", False):
        return ["--encoder-dp-balance exchanges images once per micro-batch on every data-parallel rank, and "
                "--packing gives ranks different numbers of micro-batches: drop one of them"]
    return []


def read_hf_config(args) -> None:
    """--hf-config: its dict becomes args.hf_config (as --mm-model's does) and names --model; ValueError in one
    line."""
    path = getattr(args, "hf_config_file", None)
    if not path:
        return
    if getattr(args, "hf_config", None) is not None:
        raise ValueError("--hf-config and --mm-model both give the model's shapes: keep one")
    if args.load:
        raise ValueError(f"--hf-config builds a new, randomly initialised model and --load {args.load} holds one: "
                         "drop one (a --save of an --hf-config run resumes with --load alone)")
    try:
        config = json.loads(Path(path).read_text())
        spec = registry.spec_for_hf_config(config)
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"--hf-config {path}: {exc}") from None
    if args.model == "gpt":
        args.model = spec.name
    elif args.model != spec.name:
        raise ValueError(f"--hf-config {path} holds a {spec.name} config: give --model {spec.name} (or leave "
                         "--model out)")
    args.hf_config = config


_ONE_RANK_GROUPS: dict = {}


def _one_rank_group():
    import torch.distributed as dist

    key = id(dist.group.WORLD)
    if key not in _ONE_RANK_GROUPS:
        _ONE_RANK_GROUPS.clear()
        _ONE_RANK_GROUPS[key] = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return _ONE_RANK_GROUPS[key]


class VisionLanguage(Gpt):
    """A vision-language family of the registry: its package builds the model from a converted checkpoint's
    hf/config.json (--load) or from its tiny preset (NAME-tiny)."""

    loads_converted_checkpoints = True
    splits_stages = False
    # input_ids and the 3-D positions stay whole: the model places the vision rows on the whole sequence before it
    # takes its CP part, and megatron's mrope takes its CP part of the frequencies itself
    context_parallel_split = ("labels", "loss_mask")
    forward_step = staticmethod(forward_step)

    def model_config(self, args):
        """The family's model config for this run (layout and precision from the driver's flags)."""
        layout = dict(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            pipeline_layers=pipeline_layers(args), sequence_parallel=args.sequence_parallel,
            params_dtype="bfloat16" if args.bf16 else "float16" if args.fp16 else "float32",
            # the trainer's: Megatron's training settings (providers.runtime_fields); the runner's: its flags
            extra=getattr(args, "transformer_runtime", None) or dict(
                calculate_per_token_loss=True, deallocate_pipeline_outputs=True, batch_p2p_comm=True,
                gradient_accumulation_fusion=args.gradient_accumulation_fusion,
                recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                recompute_num_layers=args.recompute_num_layers, init_method_std=args.init_method_std),
        )
        if self.tiny:
            config = self.spec.tiny_config(num_layers=args.num_layers, **layout)
        else:
            # --mm-model's, or the checkpoint's (--load's, LoRA's --load-base-model)
            hf = getattr(args, "hf_config", None) or registry.hf_config_of(families.model_home(args))
            config = self.spec.config_from_hf(hf, **layout)
        for name in ("expert_model_parallel_size", "context_parallel_size"):
            if any(f.name == name for f in dataclasses.fields(config)):
                config = dataclasses.replace(config, **{name: getattr(args, name, 1)})
        moe = getattr(args, "moe_runtime", None)  # the trainer's: Megatron's MoE arguments
        if moe and any(f.name == "moe_extra" for f in dataclasses.fields(config)):
            config = dataclasses.replace(config, moe_extra=moe)
        return config

    def shape_args(self, args) -> list[str]:
        model = args.model
        if getattr(args, "hybrid_layer_pattern", None) is not None:
            return ["--hybrid-layer-pattern builds a language model: it does not combine with the vision-language "
                    "model's flags"]
        if not self.tiny and not getattr(args, "hf_config", None):
            home = families.model_home(args)
            flag = f"--load-base-model {home}" if getattr(args, "load_base_model", None) else f"--load {home}"
            if not home:
                return [f"--model {model} needs --load MCORE_DIR (written by mm-adaptor convert hf-to-mcore)"]
            if not (Path(home) / "hf" / "config.json").is_file():
                return [f"{flag} has no hf/config.json: convert the HF checkpoint with mm-adaptor convert"]
            try:
                found = registry.spec_for_directory(home)
            except ValueError as exc:
                return [f"{flag}: {exc}"]
            if found.name != self.spec.name:
                return [f"--model {model}: {flag} holds a {found.name} checkpoint: give --model "
                        f"{found.name} (or leave --model out)"]
        try:
            if args.pipeline_layers:
                pipeline_layers(args)
            c = self.model_config(argparse.Namespace(**{**vars(args), "pipeline_layers": None}))
        except ValueError as exc:
            return [f"--model {model}: {exc}"]
        experts = getattr(c, "num_experts", None) or None
        if args.num_experts and args.num_experts != experts:
            return [f"--model {model} has {experts or 'no'} experts: drop --num-experts"]
        args.num_layers, args.hidden_size, args.ffn_hidden_size = c.num_layers, c.hidden_size, c.ffn_hidden_size
        args.num_attention_heads, args.num_query_groups, args.vocab_size = (c.num_attention_heads, c.num_query_groups,
                                                                            c.vocab_size)
        args.normalization, args.swiglu, args.disable_bias_linear = "RMSNorm", True, True
        args.position_embedding_type, args.untie_embeddings_and_output_weights = "rope", not c.tie_word_embeddings
        args.norm_epsilon = c.norm_epsilon
        if experts:
            args.num_experts, args.moe_router_topk = experts, c.num_experts_per_tok
            args.moe_ffn_hidden_size = c.moe_intermediate_size
        return []

    # Megatron's arguments the trainer sets from the family's config (shape_megatron_args)
    TINY_RUN = dict(num_layers=4, seq_length=64, micro_batch_size=2, train_iters=10, lr=1e-3)

    def shape_megatron_args(self, args) -> list[str]:
        """The model's shape into Megatron's model arguments (its FLOP count and validation read them), the tiny
        preset's run defaults, the vocabulary unpadded (the checkpoint's output layer), dropout the family's."""
        if self.tiny:
            for name, value in self.TINY_RUN.items():
                if getattr(args, name, None) is None and not (name == "train_iters" and args.train_samples):
                    setattr(args, name, value)
        problems = vlm_data.record_split_problems(args) + self.shape_args(args)
        if problems:
            return problems
        c = self.model_config(argparse.Namespace(**{**vars(args), "pipeline_layers": None}))
        if getattr(c, "num_experts", None) and args.moe_aux_loss_coeff is None:
            args.moe_aux_loss_coeff = c.moe_aux_loss_coeff  # the checkpoint's router_aux_loss_coef
        args.add_bias_linear, args.swiglu = False, True
        args.group_query_attention = c.num_query_groups != c.num_attention_heads
        args.kv_channels = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        args.rotary_base = int(getattr(c, "rope_theta", 10000))
        if args.max_position_embeddings is None:
            args.max_position_embeddings = max(args.seq_length or 0, getattr(c, "max_position_embeddings", 0))
        if args.make_vocab_size_divisible_by is None:
            args.make_vocab_size_divisible_by = 1
        elif args.make_vocab_size_divisible_by != 1:
            problems.append(f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by} pads the vocabulary, "
                            f"but {self.spec.name}'s output layer is the checkpoint's {c.vocab_size} rows: give 1 "
                            "(or leave it out)")
        for name in ("hidden_dropout", "attention_dropout"):
            if getattr(args, name) is None:
                setattr(args, name, 0.0)  # the family's (its released checkpoints train without dropout)
        return problems

    def problems(self, args) -> list[str]:
        from mm_adaptor.data.packing import problems as packing_problems

        found = packing_problems(args)
        pp = args.pipeline_model_parallel_size
        if getattr(args, "context_parallel_size", 1) > 1 and not _has_field(self.spec, "context_parallel_size"):
            found.append(f"--model {args.model}: --context-parallel-size above 1 is not built for this family (its "
                         "model config has no context_parallel_size): drop it")
        if args.virtual_pipeline_model_parallel_size:
            found.append(f"--model {args.model}: virtual pipeline stages are not supported (the vision encoder "
                         "belongs to the first virtual stage only, not built yet): drop "
                         "--num-layers-per-virtual-pipeline-stage")
        split = pipeline_layers(args) if args.pipeline_layers else None
        if split is not None and (len(split) != pp or sum(split) != args.num_layers or min(split) < 1):
            found.append(f"--pipeline-layers {args.pipeline_layers}: give {pp} stages of at least 1 language layer, "
                         f"{args.num_layers} in all")
        if getattr(args, "encoder_dp_balance", False):
            found += encoder_balance_problems(args, self.spec.name)
        if args.freeze_language and not args.freeze_vision:
            found.append("--freeze-language trains the vision encoder and projector only: add --freeze-vision "
                         "(projector-only alignment) or drop it")
        if args.freeze_language and pp > 1:
            found.append("--freeze-language with --pipeline-model-parallel-size > 1 leaves later stages nothing to "
                         "train: use tensor or data parallelism")
        if not self.tiny and not vlm_data.records_path(args):
            found.append(f"--model {args.model} needs --data-path FILE.json[l] (synthetic data is for "
                         f"{self.spec.name}-tiny)")
        if not found:
            try:  # the family's own constraints on the layout (e.g. DeepStack layers on the first stage)
                config = self.model_config(args)
            except ValueError as exc:
                return [*found, f"--model {args.model}: {exc}"]
            limit = getattr(config, "max_position_embeddings", None)
            if getattr(config, "rope_dynamic_factor", None) is not None and args.seq_length > limit:
                found.append(f"--seq-length {args.seq_length} is beyond the checkpoint's max_position_embeddings "
                             f"{limit}, where its rope_scaling 'dynamic' would rescale RoPE (not built): give "
                             f"--seq-length {limit} or less")
        return found

    def data_problems(self, args) -> list[str]:
        """The data set's one-line DataError before any rank starts."""
        if not vlm_data.records_path(args):
            return []
        return vlm_data.validate(args, self.model_config(args))

    builds_from_transformer_config = False  # its package builds both towers from the family's config

    def chunk(self, args, config, *, pre_process: bool, post_process: bool, vp_stage=None, memory: dict):
        from megatron.core import parallel_state as ps

        model = self.spec.package_module().model_provider(self.model_config(args), pre_process=pre_process,
                                                          post_process=post_process)
        memory.update(freeze(model, args))
        if getattr(args, "encoder_dp_balance", False) and model.pre_process:
            # over the data-parallel ranks and their context-parallel ranks, which hold the same images
            model.encoder_balance_group = ps.get_data_parallel_group(with_context_parallel=True)
            model.encoder_balance_home = ps.get_data_parallel_rank()
        return model

    def batches(self, args, dp_rank: int, start_iteration: int, device, chunks) -> list:
        if not vlm_data.has_records(args):
            return [None]  # an empty split (--split 100,0,0): no evaluation on it
        kind = vlm_data.DatasetBatches if vlm_data.records_path(args) else vlm_data.SyntheticBatches
        source = kind(args, self.model_config(args), dp_rank, start_iteration, device)
        if getattr(args, "packing", False):
            from mm_adaptor.data.packing import PackedBatches

            return [PackedBatches(args, dp_rank, start_iteration, device, source.packed_sample,
                                  getattr(source, "step_positions", None))]
        return [source]

    def save_side_files(self, args) -> None:
        """--save gets hf/ (config and tokenizer files) so that `mm-adaptor convert mcore-to-hf` and --load read it."""
        import shutil

        import torch.distributed as dist

        target = Path(args.save) / "hf"
        if dist.get_rank() != 0 or (target / "config.json").exists():
            return
        home = families.model_home(args)
        source = Path(home) / "hf" if home else None
        if source is not None and (source / "config.json").exists():
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            target.mkdir(parents=True, exist_ok=True)
            hf = getattr(args, "hf_config", None) or self.spec.package_module().tiny_hf_config_dict(
                self.model_config(args))
            (target / "config.json").write_text(json.dumps(hf, indent=1))


def _has_field(spec, name: str) -> bool:
    """Whether the family's model config has this field (what the family's model serves)."""
    config = spec.tiny_config()
    return any(f.name == name for f in dataclasses.fields(config))
