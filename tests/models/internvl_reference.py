"""Test helpers for InternVL: the transformers reference model (native layout, either InternViT variant), tiles,
prompts, and HF weights (either layout) cut into one rank's shards (TP, PP) through the family's mapping."""

from __future__ import annotations

import torch

from mm_adaptor.models.internvl import InternVLConfig, tiny_config, tiny_hf_config_dict

VARIANTS = {"300m": tiny_config("300m"), "6b": tiny_config("6b")}


def hf_model(config: InternVLConfig, seed: int = 0):
    """transformers' InternVLForConditionalGeneration of the config, eager attention, every weight random (it
    zero-initialises the class token, the positions and the biases, and gives norms and layer scales constants)."""
    import transformers

    torch.manual_seed(seed)
    hf_config = transformers.InternVLConfig(**tiny_hf_config_dict(config))
    for section in (hf_config, hf_config.vision_config, hf_config.text_config):
        section._attn_implementation = "eager"
    model = transformers.InternVLForConditionalGeneration(hf_config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or any(part in name for part in ("norm", "lambda", "cls_token", "position_emb")):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def tiles(count: int, size: int = 28, seed: int = 3) -> torch.Tensor:
    """[count, 3, size, size] normalised-looking pixels."""
    return torch.randn(count, 3, size, size, generator=torch.Generator().manual_seed(seed + count + size))


def prompt(config: InternVLConfig, tile_counts=(), text_lengths=(5, 4, 3), tokens_per_tile=None, seed: int = 2):
    """[1, s]: text, then per image <img>, tokens_per_tile pads per tile, </img> and more text; s even (SP)."""
    gen = torch.Generator().manual_seed(seed)
    per_tile = tokens_per_tile or config.image_seq_length
    pieces = [torch.randint(0, config.image_token_id - 10, (text_lengths[0],), generator=gen)]
    for i, count in enumerate(tile_counts):
        pieces += [torch.tensor([config.image_start_token_id]),
                   torch.full((count * per_tile,), config.image_token_id),
                   torch.tensor([config.image_end_token_id]),
                   torch.randint(0, config.image_token_id - 10, (text_lengths[1 + i % 2],), generator=gen)]
    ids = torch.cat(pieces)
    if len(ids) % 2:
        ids = torch.cat([ids, ids[:1]])
    return ids.unsqueeze(0)


def prompts(config: InternVLConfig) -> dict:
    """name -> (input_ids, pixel_values or None): text only; one image of one tile; one image of 3 tiles and its
    thumbnail; two images (2 + thumbnail, 1 tile); one tile of 42 px (positions interpolated from 4 x 4 to 6 x 6)."""
    return {
        "text_only": (prompt(config, text_lengths=(12, 4, 3)), None),
        "one_tile": (prompt(config, (1,)), tiles(1)),
        "tiles_and_thumbnail": (prompt(config, (4,)), tiles(4)),
        "two_images": (prompt(config, (3, 1)), tiles(4, seed=5)),
        "interpolated": (prompt(config, (1,), tokens_per_tile=9), tiles(1, size=42)),
    }


def positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1]).expand(ids.shape[0], -1)


def hf_logits(model, ids, pixels=None) -> torch.Tensor:
    return model(input_ids=ids, pixel_values=pixels).logits


def original_state(hf_state: dict, config: InternVLConfig) -> dict:
    """The same weights under the OpenGVLab layout's names (through the two layouts' rules)."""
    from mm_adaptor.convert import hf_to_mcore_tensors, mcore_to_hf_tensors
    from mm_adaptor.models.internvl import mapping

    hf_config = tiny_hf_config_dict(config)
    whole = hf_to_mcore_tensors(mapping.family(hf_config), hf_state)
    return mcore_to_hf_tensors(mapping.family(hf_config, layout="original"), whole)


def megatron_tensors(hf_state: dict, config: InternVLConfig, layout: str = "native") -> dict:
    from mm_adaptor.convert import hf_to_mcore_tensors
    from mm_adaptor.models.internvl import mapping, original_config_dict

    hf_config = tiny_hf_config_dict(config) if layout == "native" else original_config_dict(config)
    return hf_to_mcore_tensors(mapping.family(hf_config), hf_state)


def local_shard(model, whole: dict) -> dict:
    """This rank's state dict (TP and PP as megatron's parallel state says) from whole tensors."""
    from megatron.core import parallel_state as ps

    layers = model.language_model.decoder.layers
    size, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    out = {}
    for name, param in model.named_parameters():
        source = name
        if name.startswith("language_model.decoder.layers."):
            local = int(name.split(".")[3])
            source = name.replace(f"layers.{local}.", f"layers.{layers[local].layer_number - 1}.", 1)
        tensor = whole[source]
        if getattr(param, "tensor_model_parallel", False):
            dim = param.partition_dim
            if name.startswith("language_model.") and name.endswith("linear_fc1.weight"):  # SwiGLU: [gate; up]
                tensor = torch.cat([half.chunk(size, dim)[rank] for half in tensor.chunk(2, 0)])
            else:
                tensor = tensor.chunk(size, dim)[rank]
        out[name] = tensor
    return out


def load_hf_weights(model, hf_state: dict, config: InternVLConfig, layout: str = "native") -> None:
    """Loads an HF state dict of `layout` into this rank's model; every parameter must be covered."""
    shard = local_shard(model, megatron_tensors(hf_state, config, layout))
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert set(own) == set(shard), f"missing {set(own) - set(shard)}, unexpected {set(shard) - set(own)}"
    for key, value in shard.items():
        assert own[key].shape == value.shape, f"{key}: {tuple(own[key].shape)} vs {tuple(value.shape)}"
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in shard.items()}, strict=False)
