"""Qwen2.5-VL from megatron-core modules: vision tower + patch merger (first pipeline stage only) feeding a GPTModel
with multimodal rope. State-dict names: vision_model.*, vision_projection.*, language_model.* (see vision.py)."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.enums import ModelType
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule

from mm_adaptor.models.qwen2_5_vl.config import (
    Qwen25VLConfig, language_transformer_config, projection_config, vision_transformer_config,
)
from mm_adaptor.models.qwen2_5_vl.vision import PatchMerger, VisionModel, refuse_unbuilt_impl


class Qwen25VLModel(MegatronModule):
    """forward(input_ids [b, s], position_ids [3, b, s], ...) -> logits [b, s, vocab / TP] (whole vocab with
    runtime_gather_output=True; with labels, the per-token loss [b, s]) on the last stage, hidden states
    [s(/TP with SP), b, h] on the others. position_ids (from positions.rope_index) are needed on every stage;
    images only on the first."""

    def __init__(self, config: Qwen25VLConfig, pre_process: bool = True, post_process: bool = True,
                 parallel_output: bool = True, vp_stage: int | None = None):
        refuse_unbuilt_impl(config)
        lm_config = language_transformer_config(config)
        super().__init__(config=lm_config)
        self.model_config = config
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = config.tie_word_embeddings
        self.model_type = ModelType.encoder_or_decoder  # megatron's schedules read it
        if pre_process:
            self.vision_model = VisionModel(config, vision_transformer_config(config))
            self.vision_projection = PatchMerger(config, projection_config(config))
        self.language_model = GPTModel(
            config=lm_config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=config.vocab_size, max_sequence_length=config.max_position_embeddings,
            pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
            share_embeddings_and_output_weights=config.tie_word_embeddings, position_embedding_type="mrope",
            rotary_base=config.rope_theta, scatter_embedding_sequence_parallel=False, vp_stage=vp_stage,
        )

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    def vision_embeddings(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[merged tokens, hidden] in processor order (one row per image-pad / video-pad token)."""
        hidden, order = self.vision_model(pixel_values, grid_thw)
        merged = self.vision_projection(hidden)
        return merged[torch.argsort(order).to(merged.device)]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None, labels=None,
                pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
                loss_mask=None, runtime_gather_output: bool | None = None):
        decoder_input = None
        if self.pre_process:
            decoder_input = self._embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        return self.language_model(input_ids=None if self.pre_process else input_ids, position_ids=position_ids,
                                   attention_mask=attention_mask, decoder_input=decoder_input, labels=labels,
                                   loss_mask=loss_mask, runtime_gather_output=runtime_gather_output)

    def _embed(self, input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw):
        """Word embeddings [s, b, h] with the vision embeddings at the pad tokens, scattered for SP."""
        c = self.model_config
        text = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h], whole sequence
        batch_major = text.transpose(0, 1)
        replaced = False
        for token, pixels, grid in ((c.image_token_id, pixel_values, image_grid_thw),
                                    (c.video_token_id, pixel_values_videos, video_grid_thw)):
            at = input_ids == token
            if pixels is None:
                if bool(at.any()):
                    raise ValueError(f"input_ids hold token {token} but no pixels came for it")
                continue
            vision = self.vision_embeddings(pixels, grid).to(text.dtype)
            if int(at.sum()) != vision.shape[0]:
                raise ValueError(f"{int(at.sum())} pad tokens {token} for {vision.shape[0]} vision embeddings")
            if not replaced:
                batch_major, replaced = batch_major.clone(), True
            batch_major[at] = vision
        embeddings = batch_major.transpose(0, 1).contiguous()
        if self.config.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
        return embeddings


def model_provider(config: Qwen25VLConfig, pre_process: bool = True, post_process: bool = True,
                   vp_stage: int | None = None, parallel_output: bool = True) -> Qwen25VLModel:
    """This rank's Qwen2.5-VL stage (megatron's parallel state must be initialised). For a Megatron-LM script:
    functools.partial(model_provider, config) is a (pre_process, post_process, vp_stage) provider."""
    if vp_stage is not None:
        raise ValueError("Qwen2.5-VL: virtual pipeline stages are not supported yet")
    return Qwen25VLModel(config, pre_process=pre_process, post_process=post_process,
                         parallel_output=parallel_output, vp_stage=vp_stage)
