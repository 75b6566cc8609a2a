"""`mm-adaptor generate --load DIR --image IMG --prompt TEXT [--max-new-tokens N] [--tokenizer-model DIR]`:
greedy decoding with the Megatron Qwen2.5-VL (TP1, one process, no KV cache: the whole sequence each step).

DIR is a converted checkpoint or a training run's --save (its hf/config.json says the model's shape). The prompt is
one user turn of Qwen's chat template with the image before the text, followed by the assistant header, as the
training data lays samples out (mm_adaptor.data); decoding stops at <|im_end|> / <|endoftext|> or after N tokens."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

from mm_adaptor.core.one_line_parser import ArgumentParser


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="mm-adaptor generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="converted checkpoint or training --save directory")
    p.add_argument("--image", default=None, help="an image file (PNG/JPEG); none: a text-only prompt")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--tokenizer-model", default=None, help="HF tokenizer directory (default: DIR/hf when it holds "
                                                           "one, else the built-in byte tokenizer)")
    return p


def load_model(load_dir: str):
    """(model, Qwen25VLConfig) from the latest checkpoint under load_dir; megatron's parallel state must be set."""
    from megatron.core import dist_checkpointing

    from mm_adaptor.models.qwen2_5_vl import config_from_hf, model_provider
    from mm_adaptor.train.checkpoint import latest_checkpoint

    config = config_from_hf(json.loads((Path(load_dir) / "hf" / "config.json").read_text()))
    model = model_provider(config, pre_process=True, post_process=True).eval()
    path = latest_checkpoint(load_dir)
    if path is None:
        raise FileNotFoundError(f"--load {load_dir}: no latest_checkpointed_iteration.txt")
    request = model.sharded_state_dict(prefix="", metadata={"singleton_local_shards": False})
    model.load_state_dict(dist_checkpointing.load({"model": request}, str(path))["model"])
    return model, config


def prompt_inputs(tokenizer, prompt: str, image_path: str | None):
    """(input_ids [1, s], pixel_values or None, image_grid_thw or None) of one user turn and the assistant header."""
    import torch
    from PIL import Image

    from mm_adaptor.data import images as image_ops
    from mm_adaptor.data.records import IMAGE_TAG
    from mm_adaptor.data.vlm import encode

    pixels, grids = None, []
    if image_path:
        with Image.open(image_path) as image:
            values, grid = image_ops.preprocess(image)
        pixels, grids = torch.from_numpy(values), [tuple(grid)]
    record = SimpleNamespace(messages=[{"role": "user", "content": (IMAGE_TAG if image_path else "") + prompt}])
    ids, _ = encode(record, grids, tokenizer)
    ids += [tokenizer.special_ids["<|im_start|>"]] + tokenizer.encode("assistant\n")
    grid_thw = torch.tensor([list(g) for g in grids], dtype=torch.long) if grids else None
    return torch.tensor([ids], dtype=torch.long), pixels, grid_thw


def greedy(model, config, input_ids, pixel_values=None, image_grid_thw=None, max_new_tokens: int = 32,
           stop_ids=()) -> list[int]:
    """The new token ids, argmax of the last position each step, the whole sequence run again every step."""
    import torch

    from mm_adaptor.models.qwen2_5_vl import rope_index_for

    ids, new = input_ids, []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            positions, _ = rope_index_for(config, ids, image_grid_thw)
            logits = model(ids, positions, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                           runtime_gather_output=True)
            token = int(logits[0, -1].argmax())
            new.append(token)
            if token in stop_ids:
                break
            ids = torch.cat([ids, torch.tensor([[token]], dtype=ids.dtype)], dim=1)
    return new


def one_process_megatron():
    """A one-rank gloo group and megatron's model-parallel state, all of size 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from mm_adaptor import devices
    from mm_adaptor.ranks.launcher import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    devices.install("cpu")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.fail(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if not (Path(args.load) / "hf" / "config.json").is_file():
        parser.fail(f"--load {args.load} has no hf/config.json: give a converted checkpoint or a training --save")
    if args.image and not Path(args.image).is_file():
        parser.fail(f"--image {args.image}: no such file")
    from mm_adaptor.data import DataError, load_tokenizer
    from mm_adaptor.ranks.warning_digest import verbose

    if not verbose():  # library notices (no Transformer Engine/Apex, deprecations) are noise here
        warnings.simplefilter("ignore")
    one_process_megatron()
    model, config = load_model(args.load)
    hf = Path(args.load) / "hf"
    try:
        tokenizer = load_tokenizer(args.tokenizer_model or (str(hf) if (hf / "tokenizer.json").exists() else None),
                                   config)
        input_ids, pixels, grid = prompt_inputs(tokenizer, args.prompt, args.image)
    except DataError as exc:
        parser.fail(str(exc))
    stops = {tokenizer.special_ids["<|im_end|>"], tokenizer.special_ids["<|endoftext|>"]}
    new = greedy(model, config, input_ids, pixels, grid, args.max_new_tokens, stops)
    print(tokenizer.decode([t for t in new if t not in stops]))
    print(f"generated {len(new)} tokens: {new}", file=sys.stderr)
    return 0
