"""Qwen2.5-VL's vision tower from megatron-core modules: patch embedding, a bidirectional TransformerBlock with 2-D
rotary positions and window attention, and the patch merger.

Patches arrive as the image processor flattens them: per image, frame by frame, in blocks of merge x merge
neighbours (row-major over blocks, then within a block). The tower reorders those blocks window by window
(windows of window_size pixels, i.e. window_size / patch / merge blocks a side); layers listed in
fullatt_block_indexes attend within each frame of each image, the others within each window. The caller undoes the
order after the merger (window_layout's order).

Attention within frames and windows runs on the variable-length attention op (mm_adaptor.ops.varlen_attention):
the layers get the segments as cumulative lengths, never an [n, n] mask, so the tower's activation memory grows
linearly with the patches. attention="dense" builds the former block-diagonal masks and megatron's
DotProductAttention instead: the reference the tests and benchmarks/vision_encoder_memory.py compare with.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn

from mm_adaptor.models.megatron_config import dtype as _dtype
from mm_adaptor.models.qwen2_5_vl.config import Qwen25VLConfig
from mm_adaptor.ops.varlen_attention import bounds_for_kernel, varlen_attention


class VisionTransformerLayer(TransformerLayer):
    """A TransformerLayer handed the whole-frame and windowed segments stacked (cumulative lengths [2, L], or the
    dense masks [2, 1, 1, n, n]: one tensor, so that activation recompute can save it); uses the one its index asks
    for."""

    def __init__(self, *args, full_attention_layers=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.full_attention = (self.layer_number - 1) in tuple(full_attention_layers)

    def forward(self, *args, attention_mask=None, **kwargs):
        mask = attention_mask[0 if self.full_attention else 1]
        return super().forward(*args, attention_mask=mask, **kwargs)


ATTENTION = ("varlen", "dense")


class VarlenCoreAttention(MegatronModule):
    """Core attention of the vision layers: bidirectional attention within segments, on the varlen op. The layer's
    attention_mask slot carries the segments as cumulative lengths (an int32 CPU tensor from 0 to the patch count,
    possibly ending in repeats), so no device value is read; no [n, n] tensor is built, forward or backward."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, **unused):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"the vision tower's varlen attention takes no attention dropout (got {dropout})")
        self.softmax_scale = config.kv_channels ** -0.5 if softmax_scale is None else softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("the vision tower's varlen attention takes no attention bias or packed_seq_params")
        cu_seqlens = segment_lengths(attention_mask)
        longest = int(cu_seqlens.diff().max())
        cu_seqlens = bounds_for_kernel(cu_seqlens, query.device)
        s, b, heads, dim = query.shape
        if b != 1:
            raise ValueError(f"the vision tower's varlen attention takes one sequence of patches, got batch {b}")
        out = varlen_attention(query.view(s, heads, dim), key.view(s, key.shape[2], dim),
                               value.view(s, value.shape[2], value.shape[3]), cu_seqlens, cu_seqlens, longest,
                               longest, causal=False, softmax_scale=self.softmax_scale)
        return out.view(s, b, -1)


def segment_lengths(cumulative: torch.Tensor) -> torch.Tensor:
    """Cumulative lengths without the repeats that pad the shorter of stacked rows (int32, on the CPU)."""
    if cumulative.dtype != torch.int32 or cumulative.dim() != 1 or cumulative.device.type != "cpu":
        raise ValueError(f"the vision tower's varlen attention takes int32 cumulative lengths on the CPU, got "
                         f"{cumulative.dtype} {tuple(cumulative.shape)} on {cumulative.device}")
    return cumulative[:int(cumulative.argmax()) + 1]


def stacked_segments(*segment_ids: torch.Tensor, unit: int = 1) -> torch.Tensor:
    """One int32 CPU tensor [len(segment_ids), L]: per row, the cumulative lengths of the runs of equal ids (each id
    standing for `unit` patches), the shorter rows padded with their total."""
    rows = []
    for ids in segment_ids:
        counts = torch.unique_consecutive(ids.cpu(), return_counts=True)[1] * unit
        rows.append(torch.cat([counts.new_zeros(1), counts.cumsum(0)]))
    width = max(len(r) for r in rows)
    return torch.stack([torch.cat([r, r[-1:].expand(width - len(r))]) for r in rows]).to(torch.int32)


def dense_masks(segments: torch.Tensor, device=None) -> torch.Tensor:
    """The former masks from stacked cumulative lengths: [rows, 1, 1, n, n], True where two patches lie in
    different segments."""
    masks = []
    for row in segments:
        row = segment_lengths(row)
        ids = torch.arange(len(row) - 1).repeat_interleave(row.diff().long()).to(device)
        masks.append(_block_diagonal_mask(ids))
    return torch.stack(masks)


def vision_layer_spec(config: Qwen25VLConfig, attention: str = "varlen"):
    """The local GPT layer spec (RMSNorm, fused qkv, SwiGLU) made bidirectional, with per-layer segment choice; its
    core attention on the varlen op (or, attention="dense", megatron's on dense masks)."""
    refuse_unbuilt_impl(config)
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    spec.module = VisionTransformerLayer
    spec.params = {**spec.params, "full_attention_layers": tuple(config.fullatt_block_indexes)}
    bidirectional(spec, attention)
    return spec


def bidirectional(spec, attention: str) -> None:
    """Padding-type attention (no causal mask), its core on the varlen op unless attention="dense"."""
    if attention not in ATTENTION:
        raise ValueError(f"the vision tower's attention must be one of {ATTENTION}, got {attention!r}")
    spec.submodules.self_attention.params = {**spec.submodules.self_attention.params,
                                             "attn_mask_type": AttnMaskType.padding}
    if attention == "varlen":
        spec.submodules.self_attention.submodules.core_attention = VarlenCoreAttention


def refuse_unbuilt_impl(config: Qwen25VLConfig) -> None:
    """The Transformer Engine spec goes here once TE is installed where it can be tested; until then it refuses."""
    if config.transformer_impl == "local":
        return
    if config.transformer_impl != "transformer_engine":
        raise ValueError(f"transformer_impl must be 'local' or 'transformer_engine', got {config.transformer_impl!r}")
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        raise ValueError("transformer_impl='transformer_engine' needs Transformer Engine, which is not installed; "
                         "use transformer_impl='local'") from None
    raise NotImplementedError("Qwen2.5-VL on the Transformer Engine spec is not built yet; "
                              "use transformer_impl='local'")


def window_layout(grid_thw: torch.Tensor, merge: int, window_blocks: int):
    """For the merged blocks of all images (processor order): `order` (block indices in window order), and per
    block in window order its frame id and its window id (both unique across the batch)."""
    orders, frames, windows = [], [], []
    block_offset = frame_offset = window_offset = 0
    for t, h, w in (tuple(int(v) for v in row) for row in grid_thw):
        rows, cols = h // merge, w // merge
        win_rows, win_cols = -(-rows // window_blocks), -(-cols // window_blocks)
        f = torch.arange(t).view(t, 1, 1).expand(t, rows, cols)
        r = torch.arange(rows).view(1, rows, 1).expand(t, rows, cols)
        c = torch.arange(cols).view(1, 1, cols).expand(t, rows, cols)
        window = (f * win_rows + r // window_blocks) * win_cols + c // window_blocks
        within = (r % window_blocks) * window_blocks + c % window_blocks
        order = torch.argsort((window * window_blocks**2 + within).flatten())
        orders.append(order + block_offset)
        frames.append(f.flatten()[order] + frame_offset)
        windows.append(window.flatten()[order] + window_offset)
        block_offset += t * rows * cols
        frame_offset += t
        window_offset += t * win_rows * win_cols
    return torch.cat(orders), torch.cat(frames), torch.cat(windows)


def patch_rows_cols(grid_thw: torch.Tensor, merge: int):
    """Row and column of every patch, in processor order."""
    rows, cols = [], []
    for t, h, w in (tuple(int(v) for v in row) for row in grid_thw):
        shape = (h // merge, merge, w // merge, merge)
        r = torch.arange(h).view(h // merge, merge, 1, 1).expand(shape).permute(0, 2, 1, 3).flatten()
        c = torch.arange(w).view(1, 1, w // merge, merge).expand(shape).permute(0, 2, 1, 3).flatten()
        rows.append(r.repeat(t))
        cols.append(c.repeat(t))
    return torch.cat(rows), torch.cat(cols)


class PatchEmbed(nn.Module):
    """HF's Conv3d with kernel = stride = (temporal, patch, patch) is this linear map of a flattened patch."""

    def __init__(self, config: Qwen25VLConfig):
        super().__init__()
        self.proj = nn.Linear(config.patch_dim, config.vision_hidden_size, bias=False,
                              dtype=_dtype(config.params_dtype))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))


class VisionModel(MegatronModule):
    """Patch embedding + vision TransformerBlock (no final norm). forward -> ([patches, 1, hidden] in window
    order, the window order of merged blocks)."""

    def __init__(self, config: Qwen25VLConfig, transformer_config, attention: str = "varlen"):
        super().__init__(config=transformer_config)
        self.model_config = config
        self.attention = attention
        self.patch_embed = PatchEmbed(config)
        self.decoder = TransformerBlock(transformer_config, vision_layer_spec(config, attention),
                                        post_layer_norm=False, pre_process=True, post_process=True)

    def set_input_tensor(self, input_tensor) -> None:
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        c = self.model_config
        unit = c.spatial_merge_size**2
        window_blocks = c.window_size // c.spatial_merge_size // c.patch_size
        order, frames, windows = window_layout(grid_thw, c.spatial_merge_size, window_blocks)
        hidden = self.patch_embed(pixel_values)
        patches = hidden.shape[0]
        hidden = hidden.view(patches // unit, unit, -1)[order.to(hidden.device)].view(patches, 1, -1)

        rows, cols = patch_rows_cols(grid_thw, c.spatial_merge_size)
        # fp32 whatever the model's dtype (a buffer would be cast with the module)
        rotary_dim = self.config.kv_channels // 2
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        freqs = torch.cat([torch.outer(rows.to(inv_freq), inv_freq), torch.outer(cols.to(inv_freq), inv_freq)], -1)
        freqs = freqs.view(patches // unit, unit, -1)[order.to(freqs.device)].view(patches, -1)
        rotary = torch.cat([freqs, freqs], dim=-1)[:, None, None, :].to(hidden.device)

        segments = stacked_segments(frames, windows, unit=unit)  # frames and windows are runs in window order
        if self.attention == "dense":
            segments = dense_masks(segments, hidden.device)
        hidden = self.decoder(hidden_states=hidden, attention_mask=segments, rotary_pos_emb=rotary)
        return hidden, order


def _block_diagonal_mask(segments: torch.Tensor) -> torch.Tensor:
    """[1, 1, n, n], True where attention is not allowed (different segments)."""
    return (segments[:, None] != segments[None, :])[None, None]


class PatchMerger(MegatronModule):
    """RMSNorm over the vision hidden size, merge x merge neighbours concatenated, then fc1 -> GELU -> fc2."""

    def __init__(self, config: Qwen25VLConfig, projection_config):
        super().__init__(config=projection_config)
        self.merged_size = config.vision_hidden_size * config.spatial_merge_size**2
        self.layernorm = WrappedTorchNorm(config=projection_config, hidden_size=config.vision_hidden_size, eps=1e-6)
        self.encoder = MLP(projection_config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear),
                           input_size=self.merged_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        merged = self.layernorm(hidden).reshape(-1, 1, self.merged_size)
        out, bias = self.encoder(merged)
        if bias is not None:
            out = out + bias
        return out.squeeze(1)
