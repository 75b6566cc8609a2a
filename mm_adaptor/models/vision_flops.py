"""FLOPs of a vision-language family's vision side for one batch: the patch embedding, the vision transformer's
layers and the projector (merger), counted as Megatron counts its language model: 2 FLOPs per multiply-add of every
matrix product, attention's two products included; the norms, activations and softmax left out.

A forward pass is counted once; a trained part three times (forward, and backward for inputs and weights), a frozen
one once (nothing before it trains, so no backward runs through it). Attention spans: Qwen2.5-VL's windowed layers
attend within their window (at most window^2 patches), its full layers and every other family's within the image
(Qwen) or the tile (InternVL)."""

from __future__ import annotations


def attention_layer(tokens: int, span: int, hidden: int, ffn: int, mlp_matrices: int) -> float:
    """One transformer layer over `tokens` tokens, each attending to `span` (no GQA in these vision towers)."""
    linear = 2 * tokens * (4 * hidden * hidden + mlp_matrices * hidden * ffn)
    attention = 2 * 2 * tokens * span * hidden
    return float(linear + attention)


def qwen2_5_vl(config, grids) -> tuple[float, float]:
    """(tower, projector) forward FLOPs of the images with these [t, h, w] patch grids."""
    c = config
    window = (c.window_size // c.patch_size) ** 2  # patches a side of a window, squared
    tower = projector = 0.0
    for t, h, w in grids:
        n = t * h * w
        tower += 2.0 * n * c.patch_dim * c.vision_hidden_size
        for layer in range(c.vision_depth):
            span = h * w if layer in c.fullatt_block_indexes else min(window, h * w)
            tower += attention_layer(n, span, c.vision_hidden_size, c.vision_ffn_hidden_size, 3)
        merged, width = n // c.spatial_merge_size**2, c.vision_hidden_size * c.spatial_merge_size**2
        projector += 2.0 * merged * (width * width + width * c.hidden_size)
    return tower, projector


def qwen3_vl(config, grids) -> tuple[float, float]:
    c = config
    tower = projector = 0.0
    mergers = 1 + len(c.deepstack_visual_indexes)
    for t, h, w in grids:
        n = t * h * w
        tower += 2.0 * n * c.patch_dim * c.vision_hidden_size
        tower += c.vision_depth * attention_layer(n, h * w, c.vision_hidden_size, c.vision_ffn_hidden_size, 2)
        merged, width = n // c.spatial_merge_size**2, c.vision_hidden_size * c.spatial_merge_size**2
        projector += mergers * 2.0 * merged * (width * width + width * c.hidden_size)
    return tower, projector


def internvl(config, tiles: int) -> tuple[float, float]:
    c = config
    patches = (c.image_size // c.patch_size) ** 2
    n = patches + 1  # and the class token
    patch_dim = c.in_channels * c.patch_size**2
    tower = tiles * (2.0 * patches * patch_dim * c.vision_hidden_size
                     + c.vision_depth * attention_layer(n, n, c.vision_hidden_size, c.vision_ffn_hidden_size, 2))
    shuffled = int(round(1 / c.downsample_ratio)) ** 2
    tokens, width = patches // shuffled, c.vision_hidden_size * shuffled
    projector = tiles * 2.0 * tokens * (width * c.hidden_size + c.hidden_size * c.hidden_size)
    return tower, projector


def training_flops(tower: float, projector: float, *, tower_trained: bool, projector_trained: bool) -> float:
    return tower * (3 if tower_trained else 1) + projector * (3 if projector_trained else 1)
