"""Qwen2.5-VL from megatron-core modules: vision tower + patch merger (first pipeline stage only) feeding a GPTModel
with multimodal rope. State-dict names: vision_model.*, vision_projection.*, language_model.* (see vision.py)."""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from mm_adaptor.models.qwen2_5_vl.config import (
    Qwen25VLConfig, language_transformer_config, projection_config, vision_transformer_config,
)
from mm_adaptor.models.qwen2_5_vl.vision import PatchMerger, VisionModel, refuse_unbuilt_impl
from mm_adaptor.models.vision_language import VisionLanguageModel


class Qwen25VLModel(VisionLanguageModel):
    """VisionLanguageModel with position_ids [3, b, s] from positions.rope_index."""

    FAMILY = "Qwen2.5-VL"

    def __init__(self, config: Qwen25VLConfig, pre_process: bool = True, post_process: bool = True,
                 parallel_output: bool = True, vp_stage: int | None = None):
        refuse_unbuilt_impl(config)
        super().__init__(config, language_transformer_config(config), get_gpt_layer_local_spec(normalization="RMSNorm"),
                         pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
                         vp_stage=vp_stage)

    def build_vision(self, config: Qwen25VLConfig) -> None:
        self.vision_model = VisionModel(config, vision_transformer_config(config))
        self.vision_projection = PatchMerger(config, projection_config(config))

    def vision_embeddings(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[merged tokens, hidden] in processor order (one row per image-pad / video-pad token)."""
        hidden, order = self.vision_model(pixel_values, grid_thw)
        merged = self.vision_projection(hidden)
        return merged[torch.argsort(order).to(merged.device)]

    def visual_rows(self, pixels: torch.Tensor, grid: torch.Tensor):
        return self.vision_embeddings(pixels, grid), None


model_provider = Qwen25VLModel.stage
