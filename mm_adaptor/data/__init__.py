"""Training data for the vision-language models: MindSpeed-MM's messages format, Qwen2.5-VL batches.

    from mm_adaptor.data import build, load_tokenizer, model_token_ids
    from mm_adaptor.models.qwen2_5_vl import tiny_config

    tokenizer = load_tokenizer(None)                      # built-in bytes; or an HF tokenizer directory
    config = tiny_config(**model_token_ids(tokenizer))    # the model's special ids follow the tokenizer
    batches = build("data/shapes.json", tokenizer, config, seq_length=256, micro_batch_size=2,
                    global_batch_size=8, dp_rank=rank, dp_size=dp, start_iteration=0)
    batch = next(batches)   # dict, see mm_adaptor.data.vlm; batches.num_microbatches per iteration
    batches.report.skipped  # bad records skipped (skip_bad_samples=True), batches.report.bad: their lines

Modules: records (reading, LLaVA conversion, DataError), images (Qwen's resize and patches), tokenizer, template
(the chat template's ids), index (the data's index, built once), vlm (validation, sharding, collation), shapes (the
generated dataset), cli (`mm-adaptor data`).
Needs pillow (and transformers for a tokenizer directory): the vlm extra."""

from mm_adaptor.data.records import DataError, llava_to_messages  # noqa: F401
from mm_adaptor.data.tokenizer import (  # noqa: F401
    ByteTokenizer, HFTokenizer, SPECIAL_TOKENS, check_model_matches, load_tokenizer, model_token_ids,
)

_VLM_NAMES = ("BatchIterator", "Report", "build", "collate", "encode", "validate")


def __getattr__(name: str):
    """The batch builders import torch: only when asked for (the driver's refusals read this package's light
    modules, e.g. packing's, before any rank starts, without torch)."""
    if name in _VLM_NAMES:
        from mm_adaptor.data import vlm

        return getattr(vlm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# MindSpeed-MM's dataset_param names -> build's keyword arguments
MINDSPEED_NAMES = {"max_samples": "max_samples", "image_max_pixels": "image_max_pixels",
                   "image_min_pixels": "image_min_pixels", "cutoff_len": "seq_length", "seed": "seed"}


def options_from_mindspeed(dataset_param: dict) -> dict:
    """build's keyword arguments from MindSpeed-MM's data.json `dataset_param` (basic_parameters.dataset and
    dataset_dir, preprocess_parameters' pixel bounds, max_samples, cutoff_len); unknown names are ignored."""
    import os

    sections = [dataset_param, dataset_param.get("basic_parameters") or {},
                dataset_param.get("preprocess_parameters") or {}]
    options = {}
    for section in sections:
        options.update({ours: section[theirs] for theirs, ours in MINDSPEED_NAMES.items()
                        if section.get(theirs) is not None})
    basic = dataset_param.get("basic_parameters") or {}
    if basic.get("dataset"):
        paths = [p.strip() for p in str(basic["dataset"]).split(",") if p.strip()]
        folder = basic.get("dataset_dir") or ""
        options["data_path"] = [p if os.path.isabs(p) or not folder or os.path.exists(p) else os.path.join(folder, p)
                                for p in paths]
    return options
