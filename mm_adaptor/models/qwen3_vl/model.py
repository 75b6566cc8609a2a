"""Qwen3-VL (dense or MoE) from megatron-core modules: vision tower, patch merger and DeepStack mergers (first
pipeline stage only) feeding a GPTModel with interleaved multimodal rope, whose first layers add the DeepStack
features at the visual tokens.

State-dict names: vision_model.{patch_embed, pos_embed, decoder.layers}.*, vision_projection.*,
deepstack_projections.{k}.*, language_model.* (MoE layers: mlp.router.weight, mlp.experts.local_experts.{e}.*, the
experts megatron's local spec builds: SequentialMLP)."""

from __future__ import annotations

import copy

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn

from mm_adaptor.core.sequence_split import context_parallel_part, local_half
from mm_adaptor.models.qwen3_vl.config import (
    Qwen3VLConfig, language_transformer_config, projection_config, validate, vision_transformer_config,
)
from mm_adaptor.models.qwen3_vl.vision import PatchMerger, VisionModel, refuse_unbuilt_impl
from mm_adaptor.models.vision_language import VisionLanguageModel


def interleaved_axes(mrope_section, rotary_freqs: int) -> torch.Tensor:
    """Which position axis (0 t, 1 h, 2 w) turns each rotary frequency: T H W T H W ..., h on 1, 4, .. below
    3 * section[1], w on 2, 5, .. below 3 * section[2], t on the rest (transformers' Qwen3-VL layout)."""
    axes = torch.zeros(rotary_freqs, dtype=torch.long)
    for axis in (1, 2):
        axes[axis:3 * mrope_section[axis]:3] = axis
    return axes


class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """megatron's MultimodalRotaryEmbedding gives each axis a contiguous chunk of frequencies (TTT HHH WWW);
    Qwen3-VL interleaves them. Same inverse frequencies, same output ([s, b, 1, 2 * freqs], rotate-half layout)."""

    def forward(self, position_ids: torch.Tensor, mrope_section, cp_group=None) -> torch.Tensor:
        if self.rotary_interleaved:
            raise ValueError("Qwen3-VL: rotary_interleaved (pairwise rotation) is not Qwen3-VL's layout")
        cp_group = cp_group if cp_group is not None else getattr(self, "cp_group", None)
        positions = position_ids.to(device=self.inv_freq.device, dtype=torch.float32)
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = positions[..., None] * self.inv_freq  # [3, b, s, freqs]
        axes = interleaved_axes(mrope_section, freqs.shape[-1]).to(freqs.device)
        freqs = torch.gather(freqs, 0, axes.expand(1, *freqs.shape[1:3], -1))[0]  # [b, s, freqs]
        emb = torch.cat((freqs, freqs), dim=-1)[..., None, :].transpose(0, 1).contiguous()
        if cp_group is not None and cp_group.size() > 1:  # as megatron's: this CP rank's two chunks of the row
            emb = local_half(emb, cp_group.rank(), cp_group.size())
        return emb


class DeepStackTransformerLayer(TransformerLayer):
    """A TransformerLayer that, when handed DeepStack features, adds its own (the layer's global index) at the
    visual tokens after it ran (as transformers' Qwen3VLTextModel does).

    The features travel as the block's `context` ([features, visual tokens here, hidden]) and the visual-token
    mask as `context_mask` ([s(/TP with SP), b]): the block hands both to every layer and, under activation
    recompute, saves and restores them with the layer inputs. This decoder has no cross-attention, so nothing
    else reads them."""

    def forward(self, *args, **kwargs):
        output, context = super().forward(*args, **kwargs)
        index = self.layer_number - 1
        if context is not None and index < context.shape[0]:
            mask = kwargs["context_mask"]
            output = output.index_put((mask,), output[mask] + context[index].to(output.dtype))
        return output, context


def language_block_spec(lm_config, vp_stage: int | None = None):
    """This stage's language layers: megatron's local GPT block spec (RMSNorm, q/k norm, dense or MoE MLP per
    config.moe_layer_freq) with DeepStack layers."""
    block = get_gpt_decoder_block_spec(lm_config, use_transformer_engine=False, normalization="RMSNorm",
                                       vp_stage=vp_stage)
    specs = []
    for spec in block.layer_specs:
        spec = copy.copy(spec)
        spec.module = DeepStackTransformerLayer
        specs.append(spec)
    block.layer_specs = specs
    return block


class ShardedModuleList(nn.ModuleList):
    """A ModuleList whose checkpoint entries are its members' own sharded ones (a plain ModuleList would be saved
    as local tensors, each TP rank's shard taken for the whole tensor)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        entries = {}
        for index, member in enumerate(self):
            entries.update(member.sharded_state_dict(f"{prefix}{index}.", sharded_offsets, metadata))
        return entries


class Qwen3VLModel(VisionLanguageModel):
    """VisionLanguageModel with position_ids [3, b, s] from the interleaved rope index; the first stage also holds
    the DeepStack mergers, whose features the first language layers add at the visual tokens."""

    FAMILY = "Qwen3-VL"

    def __init__(self, config: Qwen3VLConfig, pre_process: bool = True, post_process: bool = True,
                 parallel_output: bool = True, vp_stage: int | None = None):
        refuse_unbuilt_impl(config)
        validate(config)
        lm_config = language_transformer_config(config)
        super().__init__(config, lm_config, language_block_spec(lm_config, vp_stage), pre_process=pre_process,
                         post_process=post_process, parallel_output=parallel_output, vp_stage=vp_stage)
        if config.mrope_interleaved:
            self.language_model.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(
                kv_channels=lm_config.kv_channels, rotary_percent=1.0, rotary_interleaved=lm_config.rotary_interleaved,
                rotary_base=config.rope_theta)

    def build_vision(self, config: Qwen3VLConfig) -> None:
        self.vision_model = VisionModel(config, vision_transformer_config(config))
        merger_config = projection_config(config)
        self.vision_projection = PatchMerger(config, merger_config, postshuffle=False)
        self.deepstack_projections = ShardedModuleList(
            PatchMerger(config, merger_config, postshuffle=True) for _ in config.deepstack_visual_indexes)

    def vision_embeddings(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """([merged tokens, hidden], [the DeepStack features, each [merged tokens, hidden]]) in processor order (one
        row per image-pad / video-pad token); the DeepStack list in the order the language layers take them."""
        hidden, deepstack = self.vision_model(pixel_values, grid_thw)
        return self.vision_projection(hidden), [self.deepstack_projections[k](h) for k, h in deepstack]

    def visual_rows(self, pixels: torch.Tensor, grid: torch.Tensor):
        return self.vision_embeddings(pixels, grid)

    def block_kwargs(self, placed: list, dtype: torch.dtype, packed_seq_params=None) -> dict | None:
        """The DeepStack arguments (None without DeepStack features or with config.deepstack off)."""
        visual = [(at, torch.stack(deepstack).to(dtype)) for at, deepstack in placed if deepstack]
        if not visual or not self.model_config.deepstack:
            return None
        return _deepstack_block_kwargs(visual, self.config.sequence_parallel, packed_seq_params)


def _deepstack_block_kwargs(visual, sequence_parallel: bool, packed_seq_params=None) -> dict:
    """{"context": [k, visual tokens of this rank, h] in sequence-major order, "context_mask": [s(/TP), b]}."""
    any_visual = visual[0][0].clone()
    for at, _ in visual[1:]:
        any_visual |= at
    count = int(any_visual.sum())
    features = visual[0][1].new_zeros(visual[0][1].shape[0], count, visual[0][1].shape[-1])
    for at, rows in visual:  # images and videos together, in the order of their tokens (transformers' joint list)
        features[:, at[any_visual]] = rows
    # batch-major [b, s] rows -> the order of the [s, b] hidden states (this CP rank's part of them)
    rank_in_batch_major = torch.full(any_visual.shape, -1, dtype=torch.long, device=any_visual.device)
    rank_in_batch_major[any_visual] = torch.arange(count, device=any_visual.device)
    order = rank_in_batch_major.t().contiguous()
    if parallel_state.get_context_parallel_world_size() > 1:  # cut as the embeddings are
        order = context_parallel_part(order, parallel_state.get_context_parallel_rank(),
                                      parallel_state.get_context_parallel_world_size(), packed_seq_params)
    mask = order >= 0
    features = features[:, order[mask]]
    if sequence_parallel:  # this rank's slice of the sequence; gradients summed over TP ranks on the way back
        rank = parallel_state.get_tensor_model_parallel_rank()
        local = mask.shape[0] // parallel_state.get_tensor_model_parallel_world_size()
        start = int(mask[:rank * local].sum())
        mask = mask[rank * local:(rank + 1) * local]
        features = tensor_parallel.copy_to_tensor_model_parallel_region(features)[:, start:start + int(mask.sum())]
    return {"context": features, "context_mask": mask}


model_provider = Qwen3VLModel.stage
