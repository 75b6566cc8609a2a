"""Qwen3-VL's vision tower from megatron-core modules: patch embedding (with bias), the learned position grid
bilinearly interpolated to each image, megatron TransformerLayers (LayerNorm, fused qkv, GELU-tanh MLP, 2-D rotary)
attending within each frame, and the patch mergers: the final one and one per DeepStack layer.

Patches arrive as the image processor flattens them: per image, frame by frame, in blocks of merge x merge
neighbours (row-major over blocks, then within a block). The tower keeps that order throughout.

Attention within frames runs on the variable-length attention op, the frames given as cumulative lengths (no
[n, n] mask); attention="dense" builds the former block-diagonal mask for megatron's DotProductAttention instead,
the reference for tests and benchmarks/vision_encoder_memory.py."""

from __future__ import annotations

import copy

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock
from torch import nn

from mm_adaptor.models.megatron_config import dtype as _dtype
from mm_adaptor.models.qwen2_5_vl.vision import bidirectional, dense_masks, stacked_segments
from mm_adaptor.models.qwen3_vl.config import Qwen3VLConfig


def refuse_unbuilt_impl(config: Qwen3VLConfig) -> None:
    """The Transformer Engine spec goes here once TE is installed where it can be tested; until then it refuses."""
    if config.transformer_impl == "local":
        return
    if config.transformer_impl != "transformer_engine":
        raise ValueError(f"transformer_impl must be 'local' or 'transformer_engine', got {config.transformer_impl!r}")
    raise NotImplementedError("Qwen3-VL on the Transformer Engine spec is not built yet; use transformer_impl='local'")


def vision_layer_spec(attention: str = "varlen"):
    """The local GPT layer spec (LayerNorm, fused qkv, plain MLP as the config says) made bidirectional, its core
    attention on the varlen op (or, attention="dense", megatron's on a dense mask)."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="LayerNorm"))
    bidirectional(spec, attention)
    return spec


def patch_layout(grid_thw: torch.Tensor, merge: int, side: int, device=None):
    """Per patch in processor order: row, column and frame id (unique across the batch), and the bilinear
    interpolation of the side x side position grid to its image: indices and weights [4, patches] (corners
    (floor, floor), (floor, ceil), (ceil, floor), (ceil, ceil); rows and columns sampled with
    linspace(0, side - 1, h), as transformers' Qwen3VLVisionModel.fast_pos_embed_interpolate). One step per
    image, each vectorised."""
    rows, cols, frames, indices, weights = [], [], [], [], []
    frame_offset = 0
    for t, h, w in (tuple(int(v) for v in row) for row in grid_thw):
        r = torch.arange(h, device=device)[:, None].expand(h, w)
        c = torch.arange(w, device=device)[None, :].expand(h, w)
        rows.append(_merge_blocks(r, merge).repeat(t))
        cols.append(_merge_blocks(c, merge).repeat(t))
        frames.append(torch.arange(t, device=device).repeat_interleave(h * w) + frame_offset)
        frame_offset += t

        h_at = torch.linspace(0, side - 1, h, device=device)
        w_at = torch.linspace(0, side - 1, w, device=device)
        h_floor, w_floor = h_at.int(), w_at.int()
        h_ceil, w_ceil = (h_floor + 1).clip(max=side - 1), (w_floor + 1).clip(max=side - 1)
        dh, dw = (h_at - h_floor)[:, None], (w_at - w_floor)[None, :]
        corner = torch.stack([h_floor[:, None] * side + w_floor[None], h_floor[:, None] * side + w_ceil[None],
                              h_ceil[:, None] * side + w_floor[None], h_ceil[:, None] * side + w_ceil[None]])
        weight = torch.stack([(1 - dh) * (1 - dw), (1 - dh) * dw, dh * (1 - dw), dh * dw])
        indices.append(_merge_blocks(corner, merge).repeat(1, t))
        weights.append(_merge_blocks(weight, merge).repeat(1, t))
    return (torch.cat(rows), torch.cat(cols), torch.cat(frames), torch.cat(indices, dim=1),
            torch.cat(weights, dim=1))


def _merge_blocks(x: torch.Tensor, merge: int) -> torch.Tensor:
    """[..., h, w] in raster order -> [..., h * w] in merge-block order."""
    *lead, h, w = x.shape
    return x.reshape(*lead, h // merge, merge, w // merge, merge).transpose(-3, -2).reshape(*lead, h * w)


class PatchEmbed(nn.Module):
    """HF's Conv3d (with bias) with kernel = stride = (temporal, patch, patch) is this linear map of a flattened
    patch."""

    def __init__(self, config: Qwen3VLConfig):
        super().__init__()
        self.proj = nn.Linear(config.patch_dim, config.vision_hidden_size, bias=True,
                              dtype=_dtype(config.params_dtype))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))


class VisionModel(MegatronModule):
    """Patch embedding + position grid + the vision layers (no final norm). forward -> ([patches, 1, hidden] after
    the last layer, [(DeepStack merger index, the same after that layer)] in layer order, as transformers feeds
    them to the language layers)."""

    def __init__(self, config: Qwen3VLConfig, transformer_config, attention: str = "varlen"):
        super().__init__(config=transformer_config)
        self.model_config = config
        self.attention = attention
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.vision_hidden_size,
                                      dtype=_dtype(config.params_dtype))
        self.grid_side = int(config.num_position_embeddings**0.5)
        # built as a block for its layers; forward runs them itself (the DeepStack layers' outputs are needed)
        self.decoder = TransformerBlock(transformer_config, vision_layer_spec(attention), post_layer_norm=False,
                                        pre_process=True, post_process=True)

    def set_input_tensor(self, input_tensor) -> None:
        self.decoder.set_input_tensor(input_tensor)

    def position_embeddings(self, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        corners = self.pos_embed(indices) * weights.to(self.pos_embed.weight.dtype)[:, :, None]
        return corners[0] + corners[1] + corners[2] + corners[3]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        c = self.model_config
        device = self.pos_embed.weight.device
        rows, cols, frames, indices, weights = patch_layout(grid_thw, c.spatial_merge_size, self.grid_side, device)
        hidden = self.patch_embed(pixel_values.to(device)) + self.position_embeddings(indices, weights)
        hidden = hidden[:, None, :]  # [patches, 1, hidden]

        # 2-D rotary: half the rotary frequencies turn with the row, half with the column; fp32 whatever the dtype
        rotary_dim = self.config.kv_channels // 2
        inv_freq = 1.0 / (c.vision_rope_theta ** (
            torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
        freqs = torch.cat([torch.outer(rows.float(), inv_freq), torch.outer(cols.float(), inv_freq)], -1)
        rotary = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
        mask = stacked_segments(frames)  # [1, L]: attention within each frame
        mask = dense_masks(mask, device)[0] if self.attention == "dense" else mask[0]

        recompute = self.config.recompute_granularity == "full" and self.training
        deepstack = []
        for index, layer in enumerate(self.decoder.layers):
            if recompute:  # one checkpoint per layer
                hidden = tensor_parallel.checkpoint(_layer_call(layer), False, hidden, mask, rotary)
            else:
                hidden, _ = layer(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rotary)
            if index in c.deepstack_visual_indexes:
                deepstack.append((c.deepstack_visual_indexes.index(index), hidden))
        return hidden, deepstack


def _layer_call(layer):
    def run(hidden, mask, rotary):
        return layer(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rotary)[0]

    return run


class PatchMerger(MegatronModule):
    """LayerNorm, merge x merge neighbours concatenated, then fc1 -> GELU -> fc2. The final merger normalises each
    patch (over the vision hidden size), a DeepStack merger the concatenation (postshuffle)."""

    def __init__(self, config: Qwen3VLConfig, projection_config, postshuffle: bool):
        super().__init__(config=projection_config)
        self.merged_size = config.vision_hidden_size * config.spatial_merge_size**2
        self.postshuffle = postshuffle
        norm_size = self.merged_size if postshuffle else config.vision_hidden_size
        self.layernorm = WrappedTorchNorm(config=projection_config, hidden_size=norm_size, eps=1e-6)
        self.encoder = MLP(projection_config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear),
                           input_size=self.merged_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.postshuffle:
            merged = self.layernorm(hidden.reshape(-1, 1, self.merged_size))
        else:
            merged = self.layernorm(hidden).reshape(-1, 1, self.merged_size)
        out, bias = self.encoder(merged)
        if bias is not None:
            out = out + bias
        return out.squeeze(1)
