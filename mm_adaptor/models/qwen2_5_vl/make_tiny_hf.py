"""`python -m mm_adaptor.models.qwen2_5_vl.make_tiny_hf OUT [--seed N]`: a tiny randomly initialised Qwen2.5-VL
(tiny_config's shape) written by transformers as an HF directory, for trying the converter, the driver and
`mm-adaptor generate` offline. Its special token ids are the built-in byte tokenizer's (mm_adaptor.data)."""

from __future__ import annotations

import argparse


def make_tiny_hf(out: str, seed: int = 0):
    """Writes OUT (config.json, safetensors); returns the transformers model. Biases and norms are moved off
    their constant initial values so that every weight matters."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from mm_adaptor.models.qwen2_5_vl import tiny_hf_config_dict

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**tiny_hf_config_dict())).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out)
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mm_adaptor.models.qwen2_5_vl.make_tiny_hf",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", metavar="OUT")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_tiny_hf(args.out, args.seed)
    print(f"tiny Qwen2.5-VL written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
