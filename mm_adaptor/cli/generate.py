"""`mm-adaptor generate --load DIR --image IMG --prompt TEXT [--max-new-tokens N] [--json]
[--tensor-model-parallel-size T] [--expert-model-parallel-size E]`: greedy decoding with the Megatron model of
DIR's family (no KV cache: the whole sequence each step), on T x E local ranks (or under torchrun).

DIR is a converted checkpoint or a training run's --save: its hf/config.json names the family (model_type) and its
shape. The prompt is one user turn of Qwen's chat template with the image before the text, followed by the
assistant header, as the training data lays samples out (mm_adaptor.data); decoding stops at <|im_end|> /
<|endoftext|> or after N tokens. --json prints one object: prompt_ids, new_ids, text and logprobs (the
log-probability of each chosen token under the model, in float32)."""

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
    p.add_argument("--lora", default=None, metavar="DIR",
                   help="LoRA adapters on the --load model: a LoRA run's --save, or a peft adapter converted with "
                        "mm-adaptor convert hf-to-mcore --lora")
    p.add_argument("--json", action="store_true", help="print one JSON object (prompt_ids, new_ids, text, logprobs)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1, help="for a mixture-of-experts family")
    return p


def load_model(load_dir: str, lora_dir: str | None = None, **layout):
    """(model, config) from the latest checkpoint under load_dir, built by its family (registry), with the LoRA
    adapters of lora_dir (a LoRA run's --save, or adapters converted from peft's format) on it; megatron's parallel
    state must be set to the layout's sizes."""
    import dataclasses

    from megatron.core import dist_checkpointing

    from mm_adaptor.models import registry
    from mm_adaptor.harness.runner.checkpoint import latest_checkpoint

    spec = registry.spec_for_directory(load_dir)
    config = spec.config_from_hf(registry.hf_config_of(load_dir))
    fields = {f.name for f in dataclasses.fields(config)}
    config = dataclasses.replace(config, **{k: v for k, v in layout.items() if k in fields})
    model = spec.package_module().model_provider(config, pre_process=True, post_process=True).eval()
    path = latest_checkpoint(load_dir)
    if path is None:
        raise FileNotFoundError(f"--load {load_dir}: no latest_checkpointed_iteration.txt")
    if lora_dir:
        from mm_adaptor import lora

        lora.apply(model, lora.checkpoint_settings(lora_dir))
        lora.load_base(model, load_dir)
        lora.load_adapters(model, lora_dir)
        return model.eval(), config
    request = model.sharded_state_dict(prefix="", metadata={"singleton_local_shards": False})
    model.load_state_dict(dist_checkpointing.load({"model": request}, str(path))["model"])
    return model, config


def prompt_inputs(tokenizer, prompt: str, image_path: str | None, processing=None):
    """(input_ids [1, s], pixel_values or None, image_grid_thw or None) of one user turn and the assistant header;
    processing: the family's image preprocessing (data.images.ImageProcessing), Qwen2.5-VL's by default."""
    import torch
    from PIL import Image

    from mm_adaptor.data import images as image_ops
    from mm_adaptor.data.records import IMAGE_TAG
    from mm_adaptor.data.vlm import encode

    pixels, grids = None, []
    if image_path:
        with Image.open(image_path) as image:
            values, grid = (processing or image_ops.QWEN2_5_VL).preprocess(image)
        pixels, grids = torch.from_numpy(values), [tuple(grid)]
    record = SimpleNamespace(messages=[{"role": "user", "content": (IMAGE_TAG if image_path else "") + prompt}])
    ids, _ = encode(record, grids, tokenizer, processing)
    ids += [tokenizer.special_ids["<|im_start|>"]] + tokenizer.encode("assistant\n")
    grid_thw = torch.tensor([list(g) for g in grids], dtype=torch.long) if grids else None
    return torch.tensor([ids], dtype=torch.long), pixels, grid_thw


def greedy(model, config, input_ids, pixel_values=None, image_grid_thw=None, max_new_tokens: int = 32,
           stop_ids=()) -> tuple[list[int], list[float]]:
    """The new token ids and their log-probabilities: argmax of the last position each step, the whole sequence
    run again every step."""
    import torch

    from mm_adaptor.models import rope_index_for

    ids, new, logprobs = input_ids, [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            positions, _ = rope_index_for(config, ids, image_grid_thw)
            logits = model(ids, positions, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                           runtime_gather_output=True)
            last = logits[0, -1].float()
            token = int(last.argmax())
            new.append(token)
            logprobs.append(float(torch.log_softmax(last, dim=-1)[token]))
            if token in stop_ids:
                break
            ids = torch.cat([ids, torch.tensor([[token]], dtype=ids.dtype)], dim=1)
    return new, logprobs


def init_megatron(tensor_parallel: int = 1, expert_parallel: int = 1) -> None:
    """The process group (one rank of its own when no launcher set one up) and megatron's parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel as megatron_tp

    from mm_adaptor import devices
    from mm_adaptor.ranks.launcher import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    devices.install("cpu")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    parallel_state.initialize_model_parallel(tensor_parallel, 1, expert_model_parallel_size=expert_parallel)
    megatron_tp.model_parallel_cuda_manual_seed(0)



def _generate(args) -> None:
    """One rank's decoding; rank 0 prints."""
    import torch.distributed as dist

    from mm_adaptor.data import images as image_ops
    from mm_adaptor.data.tokenizer import for_checkpoint
    from mm_adaptor.ranks.warning_digest import verbose

    if not verbose():  # library notices (no Transformer Engine/Apex, deprecations) are noise here
        warnings.simplefilter("ignore")
    init_megatron(args.tensor_model_parallel_size, args.expert_model_parallel_size)
    model, config = load_model(args.load, args.lora, tensor_model_parallel_size=args.tensor_model_parallel_size,
                               expert_model_parallel_size=args.expert_model_parallel_size)
    hf = Path(args.load) / "hf"
    tokenizer = for_checkpoint(args.tokenizer_model, args.load, config)
    processing = image_ops.ImageProcessing.for_directory(hf, config)
    input_ids, pixels, grid = prompt_inputs(tokenizer, args.prompt, args.image, processing)
    stops = {tokenizer.special_ids["<|im_end|>"], tokenizer.special_ids["<|endoftext|>"]}
    new, logprobs = greedy(model, config, input_ids, pixels, grid, args.max_new_tokens, stops)
    if dist.get_rank() == 0:
        text = tokenizer.decode([t for t in new if t not in stops])
        if args.json:
            print(json.dumps({"prompt_ids": input_ids[0].tolist(), "new_ids": new, "text": text,
                              "logprobs": logprobs}))
        else:
            print(text)
        print(f"generated {len(new)} tokens: {new}", file=sys.stderr)
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.fail(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    for flag in ("tensor_model_parallel_size", "expert_model_parallel_size"):
        if getattr(args, flag) < 1:
            parser.fail(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if not (Path(args.load) / "hf" / "config.json").is_file():
        parser.fail(f"--load {args.load} has no hf/config.json: give a converted checkpoint or a training --save")
    if args.image and not Path(args.image).is_file():
        parser.fail(f"--image {args.image}: no such file")
    if args.lora:
        from mm_adaptor import lora

        try:
            lora.checkpoint_settings(args.lora)
        except ValueError as exc:
            parser.fail(f"--lora {exc}")
    problem = _layout_problem(args)
    if problem:
        parser.fail(problem)
    from mm_adaptor.data import DataError
    from mm_adaptor.data.tokenizer import for_checkpoint
    from mm_adaptor.data import images as image_ops
    from mm_adaptor.ranks.launcher import LaunchError, launch, under_launcher

    try:  # the prompt's problems (tokenizer, image) in one line before any rank starts
        config = _config(args)
        hf = Path(args.load) / "hf"
        for_checkpoint(args.tokenizer_model, args.load, config)
        image_ops.ImageProcessing.for_directory(hf, config)
    except (DataError, ValueError) as exc:
        parser.fail(str(exc))
    ranks = args.tensor_model_parallel_size * args.expert_model_parallel_size
    if under_launcher() or ranks == 1:
        _generate(args)
        return 0
    try:
        launch(_generate, (args,), nproc=ranks, timeout=900)
    except LaunchError as exc:
        print(f"mm-adaptor generate: {exc}", file=sys.stderr)
        return 1
    return 0


def _config(args):
    from mm_adaptor.models import registry

    return registry.spec_for_directory(args.load).config_from_hf(registry.hf_config_of(args.load))


def _layout_problem(args) -> str | None:
    """One line when the model cannot take the layout (heads, key/value groups or experts not divisible)."""
    try:
        config = _config(args)
    except ValueError as exc:
        return f"--load {args.load}: {exc}"
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    for name, value in (("attention heads", config.num_attention_heads), ("key/value groups", config.num_query_groups)):
        if value % tp:
            return f"--tensor-model-parallel-size {tp}: the model's {value} {name} are not divisible by it"
    experts = getattr(config, "num_experts", None) or 0
    if ep > 1 and not experts:
        return f"--expert-model-parallel-size {ep}: the model has no experts"
    if experts and experts % ep:
        return f"--expert-model-parallel-size {ep}: the model's {experts} experts are not divisible by it"
    return None
