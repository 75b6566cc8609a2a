"""InternVL from megatron-core modules: InternViT and the pixel-shuffle projector (first pipeline stage only)
feeding a GPTModel (Qwen2 or Qwen3) with 1-D rope; the projected tiles replace the <IMG_CONTEXT> tokens' embeddings.
State-dict names: vision_model.{patch_embed, class_token, position_embeddings, decoder.layers}.*,
vision_projection.*, language_model.* (see vision.py)."""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from mm_adaptor.models.internvl.config import (
    InternVLConfig, language_transformer_config, projection_config, validate, vision_transformer_config,
)
from mm_adaptor.models.internvl.vision import Projector, VisionModel, refuse_unbuilt_impl
from mm_adaptor.models.vision_language import VisionLanguageModel


class InternVLModel(VisionLanguageModel):
    """VisionLanguageModel with 1-D positions; pixel_values [tiles, 3, S, S] in the order of their pads (no grid)."""

    FAMILY = "InternVL"

    def __init__(self, config: InternVLConfig, pre_process: bool = True, post_process: bool = True,
                 parallel_output: bool = True, vp_stage: int | None = None):
        refuse_unbuilt_impl(validate(config))
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.language_model_type == "qwen3")
        super().__init__(config, language_transformer_config(config), spec, pre_process=pre_process,
                         post_process=post_process, parallel_output=parallel_output, vp_stage=vp_stage,
                         position_embedding_type="rope")

    def build_vision(self, config: InternVLConfig) -> None:
        self.vision_model = VisionModel(config, vision_transformer_config(config))
        self.vision_projection = Projector(config, projection_config(config))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        limit = self.model_config.max_position_embeddings
        dynamic = self.model_config.rope_dynamic_factor is not None and position_ids is not None
        if dynamic and int(position_ids.max()) >= limit:
            raise ValueError(f"InternVL: position {int(position_ids.max())} is beyond max_position_embeddings {limit}, "
                             "where rope_scaling 'dynamic' would rescale RoPE (not built)")
        return super().forward(input_ids, position_ids, *args, **kwargs)

    def visual_inputs(self, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw):
        if pixel_values_videos is not None:
            raise ValueError("InternVL: videos are not supported yet")
        return ((self.model_config.image_token_id, pixel_values, None),)

    def visual_rows(self, pixels: torch.Tensor, grid):
        return self.vision_projection(self.vision_model(pixels)), None


model_provider = InternVLModel.stage
