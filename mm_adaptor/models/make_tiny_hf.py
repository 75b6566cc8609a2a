"""`python -m mm_adaptor.models.make_tiny_hf OUT [--model qwen2_5_vl|qwen3_vl|qwen3_vl_moe|internvl] [--seed N]`: a tiny
randomly initialised vision-language model (the family's tiny preset) written by transformers as an HF directory,
with its preprocessor_config.json, for trying the converter, the driver and `mm-adaptor generate` offline. Its
special token ids are the built-in byte tokenizer's (mm_adaptor.data)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from mm_adaptor.models import registry

HF_CLASSES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
              "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration", "internvl": "InternVLForConditionalGeneration"}
# zero- or constant-initialised by transformers besides biases and norms (InternViT's)
OFF_CONSTANT = ("lambda_1", "lambda_2", "cls_token", "position_embeddings")


def make_tiny_hf(out: str, model: str = "qwen2_5_vl", seed: int = 0):
    """Writes OUT (config.json, safetensors, preprocessor_config.json); returns the transformers model. Biases and
    norms are moved off their constant initial values so that every weight matters."""
    import torch
    import transformers

    from mm_adaptor.data.images import ImageProcessing

    spec, _ = registry.resolve(model)
    package = spec.package_module()
    config = spec.tiny_config()
    hf_config = package.tiny_hf_config_dict(config)
    torch.manual_seed(seed)
    hf_class = getattr(transformers, HF_CLASSES[spec.name])
    built = hf_class(transformers.AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)).eval()
    with torch.no_grad():
        for name, param in built.named_parameters():
            if name.endswith(("bias", *OFF_CONSTANT)) or "norm" in name or "ln_q" in name:
                param.add_(torch.randn_like(param) * 0.1)
    built.save_pretrained(out)
    processing = ImageProcessing.for_model(config)
    if hasattr(processing, "preprocessor_config"):  # InternVL's Tiling writes its own (GotOcr2ImageProcessor's)
        values = processing.preprocessor_config()
    else:
        values = {**dataclasses.asdict(processing), "do_resize": True, "do_rescale": True, "do_normalize": True,
                  "rescale_factor": 1 / 255, "resample": 3, "image_processor_type": "Qwen2VLImageProcessor"}
    (Path(out) / "preprocessor_config.json").write_text(json.dumps(values, indent=1))
    return built


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mm_adaptor.models.make_tiny_hf",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", metavar="OUT")
    parser.add_argument("--model", default="qwen2_5_vl", choices=sorted(HF_CLASSES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_tiny_hf(args.out, args.model, args.seed)
    print(f"tiny {args.model} written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
