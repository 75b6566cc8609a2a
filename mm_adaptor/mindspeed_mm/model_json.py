"""--mm-model FILE: MindSpeed-MM's model.json for Qwen2.5-VL (model_id qwen2_5vl) as the HF config dict the
qwen2_5_vl family builds from, the per-module pipeline split and the frozen modules. A field the model here cannot
honour, or one that contradicts the command or --load's config, is refused in one line naming both."""

from __future__ import annotations


from mm_adaptor.mindspeed_mm.json_file import read_json

# (module, field, the value the model here has): fixed in Qwen2.5-VL's architecture as built here
FIXED = (
    ("vision_encoder", "normalization", "RMSNorm"), ("vision_encoder", "layernorm_epsilon", 1e-6),
    ("vision_encoder", "gated_linear_unit", True), ("vision_encoder", "post_layer_norm", False),
    ("vision_encoder", "hidden_dropout", 0.0), ("vision_encoder", "attention_dropout", 0.0),
    ("vision_projector", "model_id", "lnmlp"), ("vision_projector", "num_layers", 1),
    ("vision_projector", "normalization", "RMSNorm"), ("vision_projector", "activation_func", "gelu"),
    ("vision_projector", "gated_linear_unit", False), ("vision_projector", "add_bias_linear", True),
    ("vision_projector", "layernorm_epsilon", 1e-6),
    ("text_decoder", "normalization", "RMSNorm"), ("text_decoder", "activation_func", "silu"),
    ("text_decoder", "gated_linear_unit", True), ("text_decoder", "position_embedding_type", "mrope"),
    ("text_decoder", "add_qkv_bias", True), ("text_decoder", "add_bias_linear", False),
    ("text_decoder", "disable_bias_linear", True), ("text_decoder", "rope_scaling", None),
    ("text_decoder", "hidden_dropout", 0.0), ("text_decoder", "attention_dropout", 0.0),
)


# the fields read (FIXED's included); those in NO_EFFECT choose their kernels or their runtime only
READ = {
    "model": {"model_id", "img_context_token_id", "vision_start_token_id", "image_encoder", "text_decoder",
              "text_encoder", "video_encoder", "patch"},
    "vision_encoder": {"model_id", "num_layers", "hidden_size", "ffn_hidden_size", "intermediate_size",
                       "llm_hidden_size", "num_attention_heads", "in_channels", "patch_size", "spatial_merge_size",
                       "temporal_patch_size", "window_attn_size", "fullatt_block_indexes", "tokens_per_second",
                       "activation_func", "freeze", "pipeline_num_layers", "bf16", "fp16", "params_dtype"},
    "vision_projector": {"input_size", "hidden_size", "ffn_hidden_size", "freeze", "bf16", "fp16", "params_dtype",
                         "context_parallel_size"},
    "text_decoder": {"model_id", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "group_query_attention", "num_query_groups", "vocab_size", "rope_theta", "mrope_section",
                     "max_position_embeddings", "layernorm_epsilon", "untie_embeddings_and_output_weights",
                     "init_method_std", "seq_length", "pipeline_num_layers", "freeze", "bf16", "fp16",
                     "params_dtype"},
}
NO_EFFECT = {
    "model": ("patch",),
    "vision_encoder": ("use_fused_rotary_pos_emb", "bias_activation_fusion", "attention_mask_type", "use_vit_dp"),
    "vision_projector": ("bias_activation_fusion",),
    "text_decoder": ("use_fused_rotary_pos_emb", "bias_activation_fusion", "attention_softmax_in_fp32",
                     "parallel_output", "use_remove_padding"),
}
NO_EFFECT_NOTE = ("their kernels' and runtime's choices (fused rope and bias-activation, softmax in fp32, "
                  "vision data parallelism, padding removal): the model computes the same here")


class ModelJsonError(ValueError):
    pass


def read(path: str) -> dict:
    model = read_json("--mm-model", path, ModelJsonError)
    if not isinstance(model, dict) or model.get("model_id") != "qwen2_5vl":
        found = model.get("model_id") if isinstance(model, dict) else type(model).__name__
        raise ModelJsonError(f"--mm-model {path}: model_id {found!r}: only qwen2_5vl (Qwen2.5-VL) is read here")
    return model


def modules(model: dict) -> dict:
    """{vision_encoder, vision_projector, text_decoder: their dicts}; raises naming a missing one."""
    image = model.get("image_encoder") or {}
    found = {"vision_encoder": image.get("vision_encoder"), "vision_projector": image.get("vision_projector"),
             "text_decoder": model.get("text_decoder")}
    missing = [name for name, value in found.items() if not isinstance(value, dict)]
    if missing:
        raise ModelJsonError(f"model.json has no {', '.join(missing)}: Qwen2.5-VL needs image_encoder."
                             "vision_encoder, image_encoder.vision_projector and text_decoder")
    for name in ("text_encoder", "video_encoder"):
        if model.get(name):
            raise ModelJsonError(f"model.json's {name} is not part of Qwen2.5-VL here: set it to null")
    return found


def field_notes(model: dict, path: str) -> list[str]:
    """One note for the fields without effect; ModelJsonError names a field that is not read here."""
    m = modules(model)
    sections = {"model": model, **m}
    fixed = {(module, name) for module, name, _ in FIXED}
    for section, fields in sections.items():
        for name in fields:
            if name not in READ[section] and name not in NO_EFFECT[section] and (section, name) not in fixed:
                raise ModelJsonError(f"--mm-model {path}: {section}.{name} is not read here (docs/mindspeed-mm.md "
                                     "lists the fields): remove it")
    if m["vision_projector"].get("context_parallel_size", 1) != 1:
        raise ModelJsonError(f"--mm-model {path}: vision_projector.context_parallel_size "
                             f"{m['vision_projector']['context_parallel_size']}: the projector runs whole here: give 1")
    given = [f"{section}.{name}" for section, names in NO_EFFECT.items() for name in names
             if name in sections[section]]
    return [f"--mm-model {path}: {', '.join(given)}: no effect here ({NO_EFFECT_NOTE})"] if given else []


def _field(module: dict, name: str, *names: str):
    """module[name], or the first of `names` present (their spellings), or KeyError."""
    for key in (name, *names):
        if key in module:
            return module[key]
    raise KeyError(name)


def hf_config(model: dict) -> dict:
    """The HF Qwen2.5-VL config dict (config.json's keys) of a model.json; ModelJsonError names a bad field."""
    m = modules(model)
    vision, projector, text = m["vision_encoder"], m["vision_projector"], m["text_decoder"]
    for module, name, value in FIXED:
        if name in m[module] and m[module][name] != value:
            raise ModelJsonError(f"model.json's {module}.{name} {m[module][name]!r}: Qwen2.5-VL here has {value!r}")
    try:
        hidden, vision_hidden = text["hidden_size"], vision["hidden_size"]
        merge = vision.get("spatial_merge_size", 2)
        # (vision_encoder.llm_hidden_size is not read: their 3B model.json gives 1280 for a 2048 language model)
        agree = (("vision_encoder.intermediate_size", vision.get("intermediate_size", vision["ffn_hidden_size"]),
                  vision["ffn_hidden_size"]),
                 ("vision_projector.input_size", projector.get("input_size", vision_hidden), vision_hidden),
                 ("vision_projector.hidden_size", projector.get("hidden_size", hidden), hidden),
                 ("vision_projector.ffn_hidden_size", projector.get("ffn_hidden_size", vision_hidden * merge ** 2),
                  vision_hidden * merge ** 2))
        for name, value, wanted in agree:
            if value != wanted:
                raise ModelJsonError(f"model.json's {name} {value} contradicts its other sizes (want {wanted})")
        gqa = text.get("group_query_attention", False)
        image_token = model.get("img_context_token_id", 151655)
        vision_start = model.get("vision_start_token_id", 151652)
        return {
            "model_type": "qwen2_5_vl",
            "vocab_size": text["vocab_size"], "hidden_size": hidden, "intermediate_size": text["ffn_hidden_size"],
            "num_hidden_layers": text["num_layers"], "num_attention_heads": text["num_attention_heads"],
            "num_key_value_heads": text["num_query_groups"] if gqa else text["num_attention_heads"],
            "rms_norm_eps": _field(text, "layernorm_epsilon", "norm_epsilon"),
            "rope_theta": text.get("rope_theta", 1000000.0),
            "rope_scaling": {"type": "mrope", "mrope_section": list(text["mrope_section"])},
            "max_position_embeddings": text.get("max_position_embeddings", 128000),
            "tie_word_embeddings": not text.get("untie_embeddings_and_output_weights", False),
            "image_token_id": image_token, "video_token_id": model.get("video_token_id", image_token + 1),
            "vision_start_token_id": vision_start, "vision_end_token_id": vision_start + 1,
            "vision_config": {
                "depth": vision["num_layers"], "hidden_size": vision_hidden,
                "intermediate_size": vision["ffn_hidden_size"], "num_heads": vision["num_attention_heads"],
                "hidden_act": vision.get("activation_func", "silu"), "patch_size": vision.get("patch_size", 14),
                "temporal_patch_size": vision.get("temporal_patch_size", 2),
                "in_channels": vision.get("in_channels", 3), "spatial_merge_size": merge,
                "window_size": vision.get("window_attn_size", 112),
                "fullatt_block_indexes": list(vision.get("fullatt_block_indexes", [])),
                "tokens_per_second": vision.get("tokens_per_second", 2), "out_hidden_size": hidden,
            },
        }
    except KeyError as exc:
        raise ModelJsonError(f"model.json lacks {exc.args[0]!r}, which Qwen2.5-VL needs") from None


def _dtype(module: dict) -> str | None:
    if module.get("bf16") or module.get("params_dtype") == "bf16":
        return "bf16"
    if module.get("fp16") or module.get("params_dtype") == "fp16":
        return "fp16"
    return "fp32" if "params_dtype" in module or "bf16" in module or "fp16" in module else None


def command_problems(model: dict, args, path: str, defaults: dict) -> list[str]:
    """Contradictions between the model.json and the flags the command gives (those away from `defaults`); sets
    the pipeline split and the freezing flags."""
    m = modules(model)
    vision, projector, text = m["vision_encoder"], m["vision_projector"], m["text_decoder"]
    problems = []
    pp = args.pipeline_model_parallel_size
    command_dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    for name, module in m.items():
        dtype = _dtype(module)
        if dtype and dtype != command_dtype:
            problems.append(f"--mm-model {path}: {name} is {dtype} but the command trains in {command_dtype}: "
                            "make them agree")
    for flag, value in (("--vocab-size", text.get("vocab_size")), ("--seq-length", text.get("seq_length"))):
        given = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and given not in (value, defaults[flag[2:].replace("-", "_")]):
            problems.append(f"{flag} {given} but --mm-model {path} has text_decoder.{flag[2:].replace('-', '_')} "
                            f"{value}: make them agree")
    if args.normalization not in ("RMSNorm", defaults["normalization"]):
        problems.append(f"--normalization {args.normalization} but --mm-model {path}'s text_decoder uses RMSNorm")
    vision_split = vision.get("pipeline_num_layers")
    if vision_split is not None:
        if len(vision_split) != pp:
            problems.append(f"--mm-model {path}: vision_encoder.pipeline_num_layers {vision_split} has "
                            f"{len(vision_split)} stages but --pipeline-model-parallel-size is {pp}")
        elif any(vision_split[1:]) or vision_split[0] != vision.get("num_layers"):
            problems.append(f"--mm-model {path}: vision_encoder.pipeline_num_layers {vision_split}: the vision "
                            f"encoder runs whole on the first stage here: give [{vision.get('num_layers')}"
                            + ", 0" * (pp - 1) + "]")
    text_split = text.get("pipeline_num_layers")
    if text_split is not None:
        if len(text_split) != pp:
            problems.append(f"--mm-model {path}: text_decoder.pipeline_num_layers {text_split} has {len(text_split)} "
                            f"stages but --pipeline-model-parallel-size is {pp}")
        else:
            split = ",".join(str(n) for n in text_split)
            if args.pipeline_layers and args.pipeline_layers.strip("[]").replace(" ", "") != split:
                problems.append(f"--pipeline-layers {args.pipeline_layers} but --mm-model {path} has "
                                f"text_decoder.pipeline_num_layers {text_split}: give one")
            elif pp > 1:
                args.pipeline_layers = split
    if all(module.get("freeze") for module in m.values()):
        problems.append(f"--mm-model {path} freezes every module: nothing would train: unfreeze one")
    for flag, module in (("freeze_vision", vision), ("freeze_projector", projector), ("freeze_language", text)):
        if module.get("freeze"):
            setattr(args, flag, True)
    if "init_method_std" in text:
        args.init_method_std = text["init_method_std"]
    return problems


def checkpoint_problem(config: dict, checkpoint: dict, path: str, load: str) -> str | None:
    """The first field where the model.json's config and --load's hf/config.json disagree (None: they agree)."""
    from mm_adaptor.models.qwen2_5_vl.config import config_from_hf

    ours, theirs = vars(config_from_hf(config)), vars(config_from_hf(checkpoint))
    for name, value in ours.items():
        if name in ("image_token_id", "video_token_id", "vision_start_token_id"):
            continue  # the tokenizer's business (the data check compares them)
        if theirs[name] != value:
            return (f"--mm-model {path} gives {name} {value} but --load {load}'s hf/config.json has {theirs[name]}: "
                    "they describe different models")
    return None
