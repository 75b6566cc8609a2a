"""InternViT and InternVL's projector from megatron-core modules.

Each tile is one sequence: the patch embedding (a Conv2d), a class token in front, the absolute position
embeddings (bicubically interpolated when the tile's patch grid differs from the trained one, as transformers
does), megatron TransformerLayers run bidirectionally with the tiles as the batch, each layer's attention and MLP
outputs scaled by their layer scale (lambda_1 / lambda_2: ScaledRowParallelLinear), the 6B class's RMSNorm over all
heads of q and k (AllHeadsRMSNorm). The projector drops the class token, pixel-shuffles neighbours into the channels
and runs LayerNorm -> Linear -> GELU -> Linear."""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock
from torch import nn

from mm_adaptor.models.internvl.config import NORMS, QK_NORM_EPS, InternVLConfig
from mm_adaptor.models.megatron_config import dtype as _dtype


def refuse_unbuilt_impl(config: InternVLConfig) -> None:
    if config.transformer_impl == "local":
        return
    if config.transformer_impl != "transformer_engine":
        raise ValueError(f"transformer_impl must be 'local' or 'transformer_engine', got {config.transformer_impl!r}")
    raise NotImplementedError("InternVL on the Transformer Engine spec is not built yet; use transformer_impl='local'")


class ScaledRowParallelLinear(RowParallelLinear):
    """A RowParallelLinear whose output, bias included, is multiplied by a learned per-channel layer scale (InternViT's
    lambda_1 after attention, lambda_2 after the MLP); it hands no separate bias on."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.layer_scale = nn.Parameter(torch.ones(output_size, dtype=config.params_dtype))

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if bias is not None:
            output = output + bias
        return output * self.layer_scale, None


class UnbiasedColumnParallelLinear(ColumnParallelLinear):
    """The 6B class's qkv: no bias, where megatron gives qkv one whenever the other linears have theirs."""

    def __init__(self, *args, bias: bool = True, **kwargs):
        super().__init__(*args, bias=False, **kwargs)


class AllHeadsRMSNorm(nn.Module):
    """InternViT-6B's QK-norm: RMSNorm over all heads of q (or k) together ([s, b, heads, head dim] as megatron's
    attention hands it), its weight split with the heads over TP; the mean square is summed across TP ranks."""

    def __init__(self, config, hidden_size: int, eps: float = QK_NORM_EPS):
        super().__init__()
        tp = config.tensor_model_parallel_size
        self.total = config.num_attention_heads * config.kv_channels
        self.weight = nn.Parameter(torch.ones(self.total // tp, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(*shape[:-2], -1).float()
        square_sum = flat.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:
            import torch.distributed.nn.functional as dist_nn

            square_sum = dist_nn.all_reduce(square_sum, group=parallel_state.get_tensor_model_parallel_group())
        normed = flat * torch.rsqrt(square_sum / self.total + QK_NORM_EPS)
        return (self.weight * normed.to(x.dtype)).reshape(shape)


def vision_layer_spec(config: InternVLConfig):
    """The local GPT layer spec with the config's norm, bidirectional, layer-scaled proj and fc2, QK-norm over all
    heads for the 6B class."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=NORMS[config.vision_norm],
                                                  qk_layernorm=config.vision_qk_norm))
    attention = spec.submodules.self_attention
    attention.params = {**attention.params, "attn_mask_type": AttnMaskType.no_mask}
    attention.submodules.linear_proj = ScaledRowParallelLinear
    if config.vision_qk_norm:
        attention.submodules.q_layernorm = AllHeadsRMSNorm
        attention.submodules.k_layernorm = AllHeadsRMSNorm
    if not config.vision_qkv_bias:
        attention.submodules.linear_qkv = UnbiasedColumnParallelLinear
    spec.submodules.mlp = _with_fc2(spec.submodules.mlp, ScaledRowParallelLinear)
    return spec


def _with_fc2(mlp, linear_fc2):
    """The MLP spec with another fc2 class: a ModuleSpec (megatron-core 0.16) or a partial of MLP.as_mlp_submodule
    holding its submodules (0.19)."""
    if isinstance(mlp, functools.partial):
        submodules = dataclasses.replace(mlp.keywords["submodules"], linear_fc2=linear_fc2)
        return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    mlp.submodules.linear_fc2 = linear_fc2
    return mlp


class VisionModel(MegatronModule):
    """forward(pixel_values [tiles, 3, S, S]) -> [1 + patches, tiles, hidden] after the vision_feature_layer."""

    def __init__(self, config: InternVLConfig, transformer_config):
        super().__init__(config=transformer_config)
        self.model_config = config
        dtype = _dtype(config.params_dtype)
        hidden = config.vision_hidden_size
        self.patch_embed = nn.Conv2d(config.in_channels, hidden, config.patch_size, stride=config.patch_size,
                                     dtype=dtype)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden, dtype=dtype))
        self.position_embeddings = nn.Parameter(torch.zeros(1, config.patches_per_side**2 + 1, hidden, dtype=dtype))
        self.decoder = TransformerBlock(transformer_config, vision_layer_spec(config), post_layer_norm=False,
                                        pre_process=True, post_process=True)

    def set_input_tensor(self, input_tensor) -> None:
        self.decoder.set_input_tensor(input_tensor)

    def positions(self, rows: int, cols: int) -> torch.Tensor:
        """[1, 1 + rows * cols, hidden]: the class position, then the patch grid resized to rows x cols."""
        side = self.model_config.patches_per_side
        if (rows, cols) == (side, side):
            return self.position_embeddings
        grid = self.position_embeddings[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(rows, cols), mode="bicubic", align_corners=False)
        return torch.cat([self.position_embeddings[:, :1], grid.permute(0, 2, 3, 1).reshape(1, rows * cols, -1)], 1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embed.weight
        patches = self.patch_embed(pixel_values.to(device=weight.device, dtype=weight.dtype))  # [t, h, r, c]
        rows, cols = patches.shape[2:]
        tokens = torch.cat([self.class_token.expand(patches.shape[0], 1, -1), patches.flatten(2).transpose(1, 2)], 1)
        hidden = (tokens + self.positions(rows, cols)).transpose(0, 1).contiguous()  # [1 + patches, tiles, hidden]
        run = self.model_config.vision_layers_run
        if run == len(self.decoder.layers):
            return self.decoder(hidden_states=hidden, attention_mask=None)
        for layer in self.decoder.layers[:run]:
            hidden, _ = layer(hidden_states=hidden, attention_mask=None)
        return hidden


def pixel_shuffle(features: torch.Tensor, shuffle: int, transposed: bool = False) -> torch.Tensor:
    """[tiles, rows, cols, hidden] -> [tiles, rows / s * cols / s, s * s * hidden]: each s x s block of neighbours
    concatenated into the channels, row offset major, column offset minor (transformers' pixel_shuffle, ps_version
    v2); `transposed` puts the column offset first (a wrong order, for negative controls)."""
    tiles, rows, cols, hidden = features.shape
    blocks = features.reshape(tiles, rows // shuffle, shuffle, cols // shuffle, shuffle, hidden)
    order = (0, 1, 3, 4, 2, 5) if transposed else (0, 1, 3, 2, 4, 5)
    return blocks.permute(*order).reshape(tiles, (rows // shuffle) * (cols // shuffle), shuffle * shuffle * hidden)


class Projector(MegatronModule):
    """Pixel shuffle, then LayerNorm -> Linear -> GELU -> Linear (transformers' multi_modal_projector, the original
    layout's mlp1)."""

    def __init__(self, config: InternVLConfig, projection_config):
        super().__init__(config=projection_config)
        self.model_config = config
        self.transposed_shuffle = False  # negative controls only
        self.layernorm = WrappedTorchNorm(config=projection_config, hidden_size=config.merged_size, eps=1e-5)
        self.encoder = MLP(projection_config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear),
                           input_size=config.merged_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [1 + patches, tiles, vision hidden] -> rows [tiles * tokens per tile, language hidden]."""
        patches = hidden[1:].transpose(0, 1)
        side = int(round(patches.shape[1] ** 0.5))
        merged = pixel_shuffle(patches.reshape(patches.shape[0], side, side, -1), self.model_config.shuffle,
                               self.transposed_shuffle)
        out, bias = self.encoder(self.layernorm(merged.reshape(-1, 1, merged.shape[-1])))
        if bias is not None:
            out = out + bias
        return out.squeeze(1)
