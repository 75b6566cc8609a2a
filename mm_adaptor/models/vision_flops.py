"""FLOPs of a vision-language family's vision side for one batch: the patch embedding, the vision transformer's
layers and the projector (merger), counted as Megatron counts its language model: 2 FLOPs per multiply-add of every
matrix product, attention's two products included; the norms, activations and softmax left out.

Attention is counted over the segments each layer attends within, as the model cuts them: Qwen2.5-VL's windowed
layers within each window of each frame, its full layers within each frame; Qwen3-VL within each frame; InternVL
within each tile (its class token included). A forward pass is counted once; a trained part three times (forward,
and backward for inputs and weights), a frozen one once (nothing before it trains, so no backward runs through it)."""

from __future__ import annotations


def layer_linear(tokens: int, hidden: int, ffn: int, mlp_matrices: int) -> float:
    """A transformer layer's matrix products but attention's own: q, k, v, the output projection and the MLP's."""
    return 2.0 * tokens * (4 * hidden * hidden + mlp_matrices * hidden * ffn)


def attention(squares: int, hidden: int) -> float:
    """Attention's two products (scores and the weighted sum) over segments whose squared lengths sum to
    `squares`."""
    return 4.0 * hidden * squares


def window_squares(t: int, h: int, w: int, merge: int, window_blocks: int) -> int:
    """Sum of squared patch counts of Qwen2.5-VL's windows (window_blocks merged blocks a side, cut from the top
    left; the last row and column of windows shorter) over the t frames of an image of h x w patches."""
    rows, cols = h // merge, w // merge
    row_sizes = [min(window_blocks, rows - i) for i in range(0, rows, window_blocks)]
    col_sizes = [min(window_blocks, cols - j) for j in range(0, cols, window_blocks)]
    return t * sum((r * c * merge * merge) ** 2 for r in row_sizes for c in col_sizes)


def qwen2_5_vl(config, grids) -> tuple[float, float]:
    """(tower, projector) forward FLOPs of the images with these [t, h, w] patch grids."""
    c = config
    blocks = c.window_size // c.spatial_merge_size // c.patch_size
    tower = projector = 0.0
    for t, h, w in grids:
        n, hv = t * h * w, c.vision_hidden_size
        full, windowed = t * (h * w) ** 2, window_squares(t, h, w, c.spatial_merge_size, blocks)
        tower += 2.0 * n * c.patch_dim * hv
        for layer in range(c.vision_depth):
            tower += layer_linear(n, hv, c.vision_ffn_hidden_size, 3)
            tower += attention(full if layer in c.fullatt_block_indexes else windowed, hv)
        merged, width = n // c.spatial_merge_size**2, hv * c.spatial_merge_size**2
        projector += 2.0 * merged * (width * width + width * c.hidden_size)
    return tower, projector


def qwen3_vl(config, grids) -> tuple[float, float]:
    c = config
    tower = projector = 0.0
    mergers = 1 + len(c.deepstack_visual_indexes)
    for t, h, w in grids:
        n, hv = t * h * w, c.vision_hidden_size
        tower += 2.0 * n * c.patch_dim * hv
        tower += c.vision_depth * (layer_linear(n, hv, c.vision_ffn_hidden_size, 2) + attention(t * (h * w) ** 2, hv))
        merged, width = n // c.spatial_merge_size**2, hv * c.spatial_merge_size**2
        projector += mergers * 2.0 * merged * (width * width + width * c.hidden_size)
    return tower, projector


def internvl(config, tiles: int) -> tuple[float, float]:
    c = config
    patches = (c.image_size // c.patch_size) ** 2
    n, hv = patches + 1, c.vision_hidden_size  # and the class token
    patch_dim = c.in_channels * c.patch_size**2
    tower = tiles * (2.0 * patches * patch_dim * hv
                     + c.vision_depth * (layer_linear(n, hv, c.vision_ffn_hidden_size, 2) + attention(n * n, hv)))
    shuffled = int(round(1 / c.downsample_ratio)) ** 2
    tokens, width = patches // shuffled, hv * shuffled
    projector = tiles * 2.0 * tokens * (width * c.hidden_size + c.hidden_size * c.hidden_size)
    return tower, projector


def training_flops(tower: float, projector: float, *, tower_trained: bool, projector_trained: bool) -> float:
    return tower * (3 if tower_trained else 1) + projector * (3 if projector_trained else 1)
