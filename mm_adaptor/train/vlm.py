"""The driver's vision-language branch (--model qwen2_5_vl / qwen2_5_vl-tiny): the model's shape as driver
arguments, its refusals, the model built through the family's model_provider with frozen towers, its batches and
its forward step. Everything else (layout, DDP, optimizer, schedule, checkpoints, logs) is the GPT path's."""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

from mm_adaptor.train import vlm_data
from mm_adaptor.core.wrapped import unwrap
from mm_adaptor.train.model import loss_func

MODELS = ("gpt", "qwen2_5_vl", "qwen2_5_vl-tiny")


def add_arguments(parser) -> None:
    g = parser.add_argument_group("vision-language models")
    g.add_argument("--model", choices=MODELS, default="gpt",
                   help="gpt: the tiny GPT (default); qwen2_5_vl: the converted checkpoint in --load "
                        "(its hf/config.json); "
                        "qwen2_5_vl-tiny: a tiny randomly initialised Qwen2.5-VL")
    g.add_argument("--data-path", default=None,
                   help="JSON/JSONL of messages and images (mm_adaptor.data); default for qwen2_5_vl-tiny: synthetic")
    g.add_argument("--tokenizer-model", default=None,
                   help="HF tokenizer directory (default: --load's hf/, else built-in)")
    g.add_argument("--pipeline-layers", default=None,
                   help="language layers per pipeline stage, e.g. 1,3 (MindSpeed-MM's --llm-pp-layers); default even")
    g.add_argument("--freeze-vision", action="store_true",
                   help="the vision encoder gets no gradient, gradient buffer or optimizer state (fine-tuning)")
    g.add_argument("--freeze-language", action="store_true",
                   help="the same for the language model (with --freeze-vision: train the projector only)")
    g.add_argument("--skip-bad-samples", action="store_true",
                   help="train on the good records of --data-path and count the bad ones, instead of refusing them")
    g.add_argument("--log-tps", action="store_true",
                   help="tokens per sample, non-padding tokens per second and samples per second (MindSpeed-MM)")


def is_vlm(args) -> bool:
    return getattr(args, "model", "gpt") != "gpt"


def hf_config_of(args) -> dict:
    return json.loads((Path(args.load) / "hf" / "config.json").read_text())


def model_config(args):
    """The Qwen25VLConfig this run builds (layout and precision from the driver's flags)."""
    from mm_adaptor.models.qwen2_5_vl import config_from_hf, tiny_config

    layout = dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        pipeline_layers=pipeline_layers(args), sequence_parallel=args.sequence_parallel,
        params_dtype="bfloat16" if args.bf16 else "float16" if args.fp16 else "float32",
        extra=dict(calculate_per_token_loss=True, deallocate_pipeline_outputs=True, batch_p2p_comm=True,
                   gradient_accumulation_fusion=args.gradient_accumulation_fusion,
                   recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                   recompute_num_layers=args.recompute_num_layers, init_method_std=args.init_method_std),
    )
    if args.model == "qwen2_5_vl-tiny":
        return tiny_config(num_layers=args.num_layers, **layout)
    return config_from_hf(hf_config_of(args), **layout)


def pipeline_layers(args) -> list[int] | None:
    if not args.pipeline_layers:
        return None
    return [int(n) for n in str(args.pipeline_layers).strip("[]").split(",")]


def shape_args(args) -> list[str]:
    """Set the language model's shape into the driver's model flags (so the layout rules check it); returns
    one line per problem that stops it."""
    if args.model == "qwen2_5_vl":
        if not args.load:
            return ["--model qwen2_5_vl needs --load MCORE_DIR (written by mm-adaptor convert hf-to-mcore)"]
        if not (Path(args.load) / "hf" / "config.json").is_file():
            return [f"--load {args.load} has no hf/config.json: convert the HF checkpoint with mm-adaptor convert"]
    try:
        if args.pipeline_layers:
            pipeline_layers(args)
        c = model_config(argparse.Namespace(**{**vars(args), "pipeline_layers": None}))
    except ValueError as exc:
        return [f"--model {args.model}: {exc}"]
    args.num_layers, args.hidden_size, args.ffn_hidden_size = c.num_layers, c.hidden_size, c.ffn_hidden_size
    args.num_attention_heads, args.num_query_groups, args.vocab_size = (c.num_attention_heads, c.num_query_groups,
                                                                        c.vocab_size)
    args.normalization, args.swiglu, args.disable_bias_linear = "RMSNorm", True, True
    args.position_embedding_type, args.untie_embeddings_and_output_weights = "rope", not c.tie_word_embeddings
    args.norm_epsilon = c.norm_epsilon
    return []


def problems(args) -> list[str]:
    """What the VLM branch cannot run (one line each), after the driver's own layout rules."""
    found = []
    pp = args.pipeline_model_parallel_size
    if args.virtual_pipeline_model_parallel_size:
        found.append(f"--model {args.model}: virtual pipeline stages are not supported (the vision encoder belongs to "
                     "the first virtual stage only, not built yet): drop --num-layers-per-virtual-pipeline-stage")
    if args.num_experts:
        found.append(f"--model {args.model} has no experts: drop --num-experts")
    split = pipeline_layers(args) if args.pipeline_layers else None
    if split is not None and (len(split) != pp or sum(split) != args.num_layers or min(split) < 1):
        found.append(f"--pipeline-layers {args.pipeline_layers}: give {pp} stages of at least 1 language layer, "
                     f"{args.num_layers} in all")
    if args.freeze_language and not args.freeze_vision:
        found.append("--freeze-language trains the vision encoder and projector only: add --freeze-vision "
                     "(projector-only alignment) or drop it")
    if args.freeze_language and pp > 1:
        found.append("--freeze-language with --pipeline-model-parallel-size > 1 leaves later stages nothing to "
                     "train: use tensor or data parallelism")
    if args.model == "qwen2_5_vl" and not args.data_path:
        found.append("--model qwen2_5_vl needs --data-path FILE.json[l] (synthetic data is for qwen2_5_vl-tiny)")
    return found


def data_problems(args) -> list[str]:
    """The data set's one-line DataError before any rank starts."""
    if not args.data_path:
        return []
    return vlm_data.validate(args, model_config(args))


def freeze(model, args) -> dict:
    """requires_grad False on the frozen towers (before DDP: no gradient buffer, no optimizer state)."""
    towers = (["vision_model"] if args.freeze_vision else []) + (["language_model"] if args.freeze_language else [])
    frozen = 0
    for name, param in model.named_parameters():
        if name.split(".")[0] in towers:
            param.requires_grad_(False)
            frozen += param.numel()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"frozen_towers": towers, "frozen_elements": frozen, "trainable_elements": trainable}


def build_model(args, device, memory: dict) -> list:
    from megatron.core import parallel_state as ps

    from mm_adaptor.models.qwen2_5_vl import model_provider

    model = model_provider(model_config(args), pre_process=ps.is_pipeline_first_stage(),
                           post_process=ps.is_pipeline_last_stage())
    memory.update(freeze(model, args))
    return [model.to(device)]


def batches(args, dp_rank: int, start_iteration: int, device):
    kind = vlm_data.DatasetBatches if args.data_path else vlm_data.SyntheticBatches
    return kind(args, model_config(args), dp_rank, start_iteration, device)


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    vision = {}
    if unwrap(model).pre_process:
        vision = dict(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    output = model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"], **vision)
    return output, partial(loss_func, batch["loss_mask"])


def save_side_files(args) -> None:
    """--save gets hf/ (config and tokenizer files) so that `mm-adaptor convert mcore-to-hf` and --load read it."""
    import shutil

    import torch.distributed as dist

    target = Path(args.save) / "hf"
    if dist.get_rank() != 0 or (target / "config.json").exists():
        return
    source = Path(args.load) / "hf" if args.load else None
    if source is not None and (source / "config.json").exists():
        shutil.copytree(source, target, dirs_exist_ok=True)
    else:
        from mm_adaptor.models.qwen2_5_vl import tiny_hf_config_dict

        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_text(json.dumps(tiny_hf_config_dict(model_config(args)), indent=1))
