"""Activation bytes the vision encoder saves for backward, for one image, with attention on the varlen op
(cumulative lengths) against the former dense block-diagonal masks with megatron's DotProductAttention (the
tower's attention="dense" reference).

Measured, not estimated: every tensor autograd saves during one training-mode forward of the tower, counted once
per storage, parameters excluded (mm_adaptor.devices.memory.SavedTensorAccountant). A 1024 x 1024 image is the
processor's 1036 x 1036 for Qwen2.5-VL (74 x 74 patches of 14 px, a multiple of 28) and 1024 x 1024 for Qwen3-VL
(64 x 64 patches of 16 px). "tiny" is the test models' tower; "realistic" has Qwen2.5-VL-3B's / Qwen3-VL-8B's vision
width and heads with --realistic-layers layers (window then full attention for Qwen2.5-VL), in bfloat16.

    python benchmarks/vision_encoder_memory.py [--image-side 1024] [--families qwen2_5_vl,qwen3_vl]
        [--widths tiny,realistic] [--realistic-layers 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import init_single_rank, print_table_header  # noqa: E402

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
WIDTHS = ("tiny", "realistic")
COLUMNS = ["encoder", "width", "layers", "patches", "attention", "saved MiB", "saved MiB per layer",
           "dense / varlen"]


def family_config(family: str, width: str, layers: int):
    if family == "qwen2_5_vl":
        from mm_adaptor.models.qwen2_5_vl import config as module

        if width == "tiny":
            return module, module.tiny_config()
        return module, dataclasses.replace(module.Qwen25VLConfig(), vision_depth=layers,
                                           fullatt_block_indexes=(layers - 1,), params_dtype="bfloat16")
    from mm_adaptor.models.qwen3_vl import config as module

    if width == "tiny":
        return module, module.tiny_config()
    return module, dataclasses.replace(module.Qwen3VLConfig(), vision_depth=layers, deepstack_visual_indexes=(0,),
                                       params_dtype="bfloat16")


def image_grid(family: str, config, side: int) -> torch.Tensor:
    """The processor's grid for one side x side image: sides rounded to a multiple of patch * merge."""
    unit = config.patch_size * config.spatial_merge_size
    blocks = max(1, round(side / unit))
    return torch.tensor([[1, blocks * config.spatial_merge_size, blocks * config.spatial_merge_size]])


def vision_model(family: str, config, attention: str):
    if family == "qwen2_5_vl":
        from mm_adaptor.models.qwen2_5_vl.config import vision_transformer_config
        from mm_adaptor.models.qwen2_5_vl.vision import VisionModel
    else:
        from mm_adaptor.models.qwen3_vl.config import vision_transformer_config
        from mm_adaptor.models.qwen3_vl.vision import VisionModel
    torch.manual_seed(0)
    return VisionModel(config, vision_transformer_config(config), attention=attention).train()


def saved_bytes(family: str, config, grid: torch.Tensor, attention: str) -> tuple[int, int]:
    """(bytes saved for backward by one forward of the tower, patches)."""
    from mm_adaptor.devices.memory import SavedTensorAccountant

    model = vision_model(family, config, attention)
    patches = int(grid.prod())
    pixels = torch.randn(patches, config.patch_dim, generator=torch.Generator().manual_seed(1))
    accountant = SavedTensorAccountant([model])
    try:
        with accountant.hooks():
            out = model(pixels, grid)
        total = sum(accountant.bytes_per_layer("device").values())  # the layers' and what is saved outside them
    finally:
        accountant.close()
    del out
    return total, patches


def measure(family: str, width: str, side: int, layers: int) -> list[dict]:
    _, config = family_config(family, width, layers)
    grid = image_grid(family, config, side)
    rows = {}
    for attention in ("dense", "varlen"):
        total, patches = saved_bytes(family, config, grid, attention)
        rows[attention] = {"encoder": family, "width": width, "layers": config.vision_depth, "patches": patches,
                           "attention": attention, "bytes": total}
    ratio = rows["dense"]["bytes"] / rows["varlen"]["bytes"]
    for row in rows.values():
        row["dense / varlen"] = ratio
    return list(rows.values())


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image-side", type=int, default=1024)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--widths", default=",".join(WIDTHS))
    parser.add_argument("--realistic-layers", type=int, default=2)
    args = parser.parse_args(argv)
    args.families, args.widths = args.families.split(","), args.widths.split(",")
    for name, chosen, allowed in (("--families", args.families, FAMILIES), ("--widths", args.widths, WIDTHS)):
        if not set(chosen) <= set(allowed):
            parser.error(f"{name} takes {', '.join(allowed)}; got {','.join(chosen)}")
    if args.image_side < 28 or args.realistic_layers < 2:
        parser.error("--image-side must be at least 28 and --realistic-layers at least 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from mm_adaptor import devices

    from megatron.core import tensor_parallel

    devices.install("cpu")
    init_single_rank("gloo")
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    print_table_header(f"one {args.image_side} x {args.image_side} image, training-mode forward", COLUMNS)
    for family in args.families:
        for width in args.widths:
            for row in measure(family, width, args.image_side, args.realistic_layers):
                mib = row["bytes"] / 2**20
                print(f"| {row['encoder']} | {row['width']} | {row['layers']} | {row['patches']} | {row['attention']} "
                      f"| {mib:.1f} | {mib / row['layers']:.1f} | {row['dense / varlen']:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
