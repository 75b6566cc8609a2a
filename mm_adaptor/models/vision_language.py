"""What every vision-language family shares: a vision tower and its projection on the first pipeline stage, feeding
a megatron-core GPTModel whose word embeddings get the vision rows at the visual pad tokens.

A family subclasses VisionLanguageModel and says how its towers are built (build_vision), what one visual input
turns into (visual_rows) and, where its decoder takes more than the embeddings, what the block gets
(block_kwargs)."""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule

from mm_adaptor.core.sequence_split import context_parallel_part
from mm_adaptor.models.encoder_balance import ENCODER_CLOCK


class VisionLanguageModel(MegatronModule):
    """forward(input_ids [b, s], position_ids, ...) -> logits [b, s, vocab / TP] (whole vocab with
    runtime_gather_output=True; with labels, the per-token loss [b, s]) on the last stage, hidden states
    [s(/TP with SP), b, h] on the others. position_ids are needed on every stage; pixels only on the first."""

    def __init__(self, config, lm_config, language_layer_spec, pre_process: bool = True, post_process: bool = True,
                 parallel_output: bool = True, vp_stage: int | None = None, position_embedding_type: str = "mrope"):
        super().__init__(config=lm_config)
        self.model_config = config
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = config.tie_word_embeddings
        self.model_type = ModelType.encoder_or_decoder  # megatron's schedules read it
        if pre_process:  # before the language model: the towers' parameters come first, as they always have
            self.build_vision(config)
        self.language_model = GPTModel(
            config=lm_config, transformer_layer_spec=language_layer_spec,
            vocab_size=config.vocab_size, max_sequence_length=config.max_position_embeddings,
            pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
            share_embeddings_and_output_weights=config.tie_word_embeddings,
            position_embedding_type=position_embedding_type, rotary_base=config.rope_theta,
            scatter_embedding_sequence_parallel=False, vp_stage=vp_stage,
        )

    FAMILY = ""  # the family's name in messages

    @classmethod
    def stage(cls, config, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
              parallel_output: bool = True):
        """This rank's stage of the model (megatron's parallel state must be initialised, with the expert sizes of
        the config for MoE). For a Megatron-LM script: functools.partial(model_provider, config) is a
        (pre_process, post_process, vp_stage) provider; each family's model_provider is this."""
        if vp_stage is not None:
            raise ValueError(f"{cls.FAMILY}: virtual pipeline stages are not supported yet")
        return cls(config, pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
                   vp_stage=vp_stage)

    def build_vision(self, config) -> None:
        raise NotImplementedError

    def visual_rows(self, pixels: torch.Tensor, grid: torch.Tensor):
        """(rows [visual tokens, hidden] in the order of their pad tokens, anything block_kwargs needs of them)."""
        raise NotImplementedError

    def patches_per_row(self) -> int:
        """Pixel rows of one visual row (the patches a merger joins): --encoder-dp-balance splits rows by it."""
        return self.model_config.spatial_merge_size ** 2

    def balanced_visual_rows(self, pixels, grid, group, device) -> torch.Tensor:
        """visual_rows of this rank's images, encoded where encoder_balance.assign put them over `group`."""
        from mm_adaptor.models.encoder_balance import balanced_rows

        def encode(given, grids):
            rows, extra = ENCODER_CLOCK.timed(self.visual_rows, given, grids)
            if extra is not None:
                raise ValueError(f"{self.FAMILY}: --encoder-dp-balance returns rows only, not its encoder's extras")
            return rows

        vision = [p for name, p in self.named_parameters() if not name.startswith("language_model.")]
        return balanced_rows(encode, pixels, grid, group, merge=self.patches_per_row(),
                             hidden=self.language_model.config.hidden_size, dtype=vision[0].dtype,
                             trainable=any(p.requires_grad for p in vision), device=device,
                             home=getattr(self, "encoder_balance_home", None),
                             return_order=getattr(self, "encoder_balance_return_order", None))

    def block_kwargs(self, placed: list, dtype: torch.dtype, packed_seq_params=None) -> dict | None:
        """The decoder block's extra arguments, from [(pad-token mask [b, s], visual_rows' extra)] of this batch
        (whole sequences: the CP rank's part is the family's to take, of each segment of a pack)."""
        return None

    def visual_inputs(self, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw):
        """[(pad token id, pixels or None, grid)] in the order the rows are placed."""
        c = self.model_config
        return ((c.image_token_id, pixel_values, image_grid_thw),
                (c.video_token_id, pixel_values_videos, video_grid_thw))

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    @property
    def pg_collection(self):
        """The language model's process groups (megatron 0.19's training loop reads them off the model)."""
        return getattr(self.language_model, "pg_collection", None)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None, labels=None,
                pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
                loss_mask=None, runtime_gather_output: bool | None = None, packed_seq_params=None):
        decoder_input, block_kwargs = None, None
        if self.pre_process:
            decoder_input, block_kwargs = self.embed(
                input_ids, self.visual_inputs(pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw),
                packed_seq_params)
        return self.language_model(input_ids=None if self.pre_process else input_ids, position_ids=position_ids,
                                   attention_mask=attention_mask, decoder_input=decoder_input, labels=labels,
                                   loss_mask=loss_mask, runtime_gather_output=runtime_gather_output,
                                   extra_block_kwargs=block_kwargs, packed_seq_params=packed_seq_params)

    def embed(self, input_ids: torch.Tensor, visual_inputs, packed_seq_params=None):
        """Word embeddings [s, b, h] with the visual rows at their pad tokens, cut to this CP rank's part (of each
        segment of a pack) and scattered for SP, and the decoder block's extra arguments."""
        text = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h], whole sequence
        batch_major = text.transpose(0, 1)
        placed, exchanged = [], []
        balance = getattr(self, "encoder_balance_group", None)  # --encoder-dp-balance
        for token, pixels, grid in visual_inputs:
            at = input_ids == token
            if balance is not None:  # every rank of the group takes part, with or without pixels
                exchanged.append(self.balanced_visual_rows(pixels, grid, balance, input_ids.device))
            if pixels is None:
                if bool(at.any()):
                    raise ValueError(f"input_ids hold token {token} but no pixels came for it")
                continue
            rows, extra = (exchanged[-1], None) if balance is not None else \
                ENCODER_CLOCK.timed(self.visual_rows, pixels, grid)
            if int(at.sum()) != rows.shape[0]:
                raise ValueError(f"{int(at.sum())} pad tokens {token} for {rows.shape[0]} vision embeddings")
            if not placed:
                batch_major = batch_major.clone()
            batch_major[at] = rows.to(text.dtype)
            placed.append((at, extra))
        embeddings = batch_major.transpose(0, 1).contiguous()
        if any(rows.requires_grad and rows.numel() == 0 for rows in exchanged):
            # no rows of this rank's own: a zero keeps the exchange in the graph, whose backward every rank joins
            embeddings = embeddings + sum(rows.sum() for rows in exchanged) * 0
        block_kwargs = self.block_kwargs(placed, text.dtype, packed_seq_params) if placed else None
        if self.config.context_parallel_size > 1:  # input_ids came whole: this CP rank's part of the sequence
            embeddings = context_parallel_part(embeddings, parallel_state.get_context_parallel_rank(),
                                               self.config.context_parallel_size, packed_seq_params)
        if self.config.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
        return embeddings, block_kwargs
