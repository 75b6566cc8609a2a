"""InternVL's model and optimizer state per rank, from the config's shapes (no model built), for a layout the
user names: TP, uneven PP (InternViT and the projector on the first stage), DP, the distributed optimizer, bf16
with Adam, and the optimizer-state features of docs/memory.md (--reuse-fp32-param, --swap-optimizer,
--virtual-optimizer). Per element of a rank's parameters: 2 B bf16 parameter, 4 B fp32 gradient buffer (DDP's
main_grad); per element of the rank's optimizer shard (all of them, or 1 / DP with the distributed optimizer):
4 B fp32 main parameter (2 B with --reuse-fp32-param), 8 B moments; --swap-optimizer and --virtual-optimizer keep
main parameters and moments in host memory.

Activations (`language_layer_saved`, `vision_layer_saved`, `stage_activations`): the storages autograd keeps per
transformer layer for one micro-batch, as devices.memory.SavedTensorAccountant counts them (each storage once,
whole), on the local spec with the driver's unfused paths and no dropout, for a layout (TP, SP, micro-batch,
sequence, tiles) and the activation features: --use-flash-attn, --recompute-activation-function, --swap-attention
(--swap-select bandwidth: each block's last layer stays on the device; all: it moves too), full recompute,
--freeze-vision."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mm_adaptor.models.internvl.config import InternVLConfig

GB = 1e9


def internvit_elements(c: InternVLConfig, tp: int = 1) -> int:
    """InternViT on one TP rank."""
    vh, ffn = c.vision_hidden_size, c.vision_ffn_hidden_size
    norm = 2 * vh if c.vision_norm == "layer_norm" else vh
    layer = (3 * vh * vh + (3 * vh if c.vision_qkv_bias else 0)) // tp  # qkv
    layer += vh * vh // tp + vh + vh  # proj, its bias, lambda_1
    layer += (ffn * vh + ffn) // tp + vh * ffn // tp + vh + vh  # fc1, fc2, its bias, lambda_2
    layer += 2 * norm + (2 * vh // tp if c.vision_qk_norm else 0)
    embeddings = c.in_channels * c.patch_size**2 * vh + vh + vh + (c.patches_per_side**2 + 1) * vh
    return embeddings + c.vision_depth * layer


def projector_elements(c: InternVLConfig, tp: int = 1) -> int:
    merged, h = c.merged_size, c.hidden_size
    return 2 * merged + (h * merged + h) // tp + h * h // tp + h


def language_layer_elements(c: InternVLConfig, tp: int = 1) -> int:
    h, hd, heads, kv = c.hidden_size, c.kv_channels, c.num_attention_heads, c.num_query_groups
    qkv_rows = (heads + 2 * kv) * hd
    qwen3 = c.language_model_type == "qwen3"
    layer = (qkv_rows * h + (0 if qwen3 else qkv_rows)) // tp + h * heads * hd // tp
    layer += 3 * c.ffn_hidden_size * h // tp + 2 * h + (2 * hd if qwen3 else 0)
    return layer


def stage_elements(c: InternVLConfig, tp: int, split: list[int], stage: int) -> int:
    """Parameter elements of one rank of pipeline stage `stage` (split: language layers per stage)."""
    first, last = stage == 0, stage == len(split) - 1
    out = split[stage] * language_layer_elements(c, tp)
    if first:
        out += internvit_elements(c, tp) + projector_elements(c, tp) + c.vocab_size * c.hidden_size // tp
    if last:
        out += c.hidden_size + (0 if c.tie_word_embeddings and first else c.vocab_size * c.hidden_size // tp)
    return out


@dataclass(frozen=True)
class RankState:
    elements: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_main_param_bytes: int
    optimizer_moment_bytes: int
    host_optimizer: bool

    @property
    def device_bytes(self) -> int:
        optimizer = self.optimizer_main_param_bytes + self.optimizer_moment_bytes
        return self.parameter_bytes + self.gradient_bytes + (0 if self.host_optimizer else optimizer)

    @property
    def host_bytes(self) -> int:
        return self.optimizer_main_param_bytes + self.optimizer_moment_bytes if self.host_optimizer else 0


def rank_state(c: InternVLConfig, tp: int, split: list[int], dp: int, distributed_optimizer: bool = True,
               reuse_fp32_param: bool = False, host_optimizer: bool = False, stage: int | None = None,
               params_dtype: str = "bfloat16", frozen_vision: bool = False) -> RankState:
    """One rank of `stage` (default: of the stage with the most parameters). fp32 runs keep no separate main
    parameters; a frozen InternViT (--freeze-vision) has no gradient or optimizer state."""
    stages = range(len(split)) if stage is None else [stage]
    stage = max(stages, key=lambda s: stage_elements(c, tp, split, s))
    elements = stage_elements(c, tp, split, stage)
    trainable = elements - (internvit_elements(c, tp) if frozen_vision and stage == 0 else 0)
    shard = -(-trainable // dp) if distributed_optimizer else trainable
    fp32 = params_dtype == "float32"
    main = 0 if fp32 else shard * (2 if reuse_fp32_param else 4)
    return RankState(elements, elements * (4 if fp32 else 2), trainable * 4, main, shard * 8, host_optimizer)


def markdown_table(c: InternVLConfig, layouts: dict) -> str:
    """Rows per named layout (tp, split, dp) x feature setting: per-rank device and host GB."""
    settings = {"unpatched (distributed optimizer)": {}, "no distributed optimizer": {"distributed_optimizer": False},
                "--reuse-fp32-param": {"reuse_fp32_param": True},
                "--swap-optimizer / --virtual-optimizer": {"host_optimizer": True}}
    lines = ["| layout | parameters per rank | " + " | ".join(settings) + " |",
             "|---|---|" + "---|" * len(settings)]
    for name, (tp, split, dp) in layouts.items():
        cells = []
        for kwargs in settings.values():
            state = rank_state(c, tp, split, dp, **kwargs)
            cells.append(f"{state.device_bytes / GB:.1f}" + (f" (+{state.host_bytes / GB:.1f} host)"
                                                             if state.host_bytes else ""))
        elements = rank_state(c, tp, split, dp).elements
        lines.append(f"| {name} | {elements / 1e9:.2f} B | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def internvit_6b(**language) -> InternVLConfig:
    """InternViT-6B-448px-V2_5 (45 layers, 3200 wide, 25 heads, RMSNorm, QK-norm) with a Qwen2-architecture
    language model of the given shape."""
    return InternVLConfig(vision_depth=45, vision_hidden_size=3200, vision_ffn_hidden_size=12800, vision_num_heads=25,
                          vision_norm="rms_norm", vision_qkv_bias=False, vision_qk_norm=True, **language)


def internvl2_5_78b() -> InternVLConfig:
    """InternVL2.5-78B: InternViT-6B + Qwen2.5-72B (its config.json's values)."""
    return internvit_6b(vocab_size=151674, hidden_size=8192, ffn_hidden_size=29568, num_layers=80,
                        num_attention_heads=64, num_query_groups=8)


def internvl_110b_class() -> InternVLConfig:
    """A 110B-class InternVL: InternViT-6B + a Qwen1.5-110B-shaped language model (80 layers, 8192 wide, 49152
    MLP, 64 heads, 8 key/value heads, 152064 vocab)."""
    return internvit_6b(vocab_size=152064, hidden_size=8192, ffn_hidden_size=49152, num_layers=80,
                        num_attention_heads=64, num_query_groups=8)


@dataclass(frozen=True)
class Activations:
    """A layout and the activation features for one micro-batch. tiles: InternViT tiles in the micro-batch (tiles
    per sample x micro-batch); bf16: 2 B activations (else fp32); swap_min_bytes: --swap-min-bytes; swap_select:
    --swap-select. Under "all" every swapped layer's chosen storages move (see `placed`). Under "bandwidth" (the
    default) the last layer of each block pass keeps everything on the device (each language stage's last language
    layer, InternViT's last layer on the first stage) and the others move as under "all": that is exactly what the
    first passes of each block move (patches/transformer/swap_attention.py swaps every other candidate while it
    times the link in its first MEASURED_PASSES passes), and from then on the most the selection can move. On a slow
    link the bandwidth rule keeps more layers on the device, known only at run time: the formula's host bytes are
    an upper bound of what moves, its device bytes a lower bound."""
    tp: int = 1
    sp: bool = False
    micro_batch: int = 1
    seq_length: int = 4096
    tiles: int = 0
    bf16: bool = True
    flash_attn: bool = False
    recompute_activation: bool = False
    swap_attention: bool = False
    swap_min_bytes: int = 64 * 1024
    swap_select: str = "bandwidth"  # --swap-select: "bandwidth" (the last layer of a block stays) or "all"
    full_recompute: bool = False
    frozen_vision: bool = False  # --freeze-vision: nothing upstream of the projector needs a gradient

    def __post_init__(self):
        if self.swap_select not in ("bandwidth", "all"):
            raise ValueError(f"swap_select {self.swap_select!r}: choose bandwidth or all")

    @property
    def element(self) -> int:
        return 2 if self.bf16 else 4


@dataclass(frozen=True)
class Saved:
    """One storage a layer keeps for backward. layer_input: the layer's input itself, which its caller holds too."""
    module: str  # the TransformerLayer child that saves it
    what: str
    nbytes: int
    layer_input: bool = False


SWAPPED = ("input_layernorm", "self_attention", "pre_mlp_layernorm")  # --swap-attention's default modules


def _norm(module, kind, tokens, width, e, input_bytes) -> list[Saved]:
    """torch's RMSNorm keeps its input as fp32 (a new storage below fp32), the normalised fp32 rows and fp32 rstd;
    LayerNorm its input, mean and rstd in the activation dtype. The input layernorm's input is the layer's."""
    first = module == "input_layernorm"
    if kind == "rms_norm":
        own = e != 4
        return [Saved(module, "input as fp32", tokens * width * 4 if own else input_bytes, first and not own),
                Saved(module, "normalised fp32", tokens * width * 4), Saved(module, "rstd", tokens * 4)]
    return [Saved(module, "input", input_bytes, first), Saved(module, "mean, rstd", 2 * tokens * e)]


def _core_attention(a: Activations, batch, heads, seq, head_dim, masked) -> list[Saved]:
    """Megatron's unfused attention keeps the softmax's fp32 probabilities (and their copy in a 16-bit dtype),
    the causal mask and the context; blockwise attention (--use-flash-attn) keeps no [s, s] but its output and
    fp32 log-sum-exp."""
    e, rows = a.element, batch * heads * seq
    if a.flash_attn:
        return [Saved("self_attention", "attention output", rows * head_dim * e),
                Saved("self_attention", "log-sum-exp", rows * 4)]
    out = [Saved("self_attention", "fp32 probabilities", rows * seq * 4),
           Saved("self_attention", "context (proj input)", rows * head_dim * e)]
    if e != 4:
        out.append(Saved("self_attention", "probabilities copy", rows * seq * e))
    if masked:
        out.append(Saved("self_attention", "causal mask", seq * seq))
    return out


def language_layer_saved(c: InternVLConfig, a: Activations, first_of_model: bool = False) -> list[Saved]:
    """One Qwen2 language layer. Under SP the norms and linears' inputs are a rank's s / TP tokens; the model's first
    layer keeps the whole [s, b, h] embedding storage its scattered input is a view of (fp32: the norm keeps it)."""
    if c.language_model_type != "qwen2" or c.num_query_groups == c.num_attention_heads:
        raise ValueError("activation formula: only Qwen2 language models with grouped-query attention are modelled")
    t, b, s, e = a.tp, a.micro_batch, a.seq_length, a.element
    h, d, heads, ffn = c.hidden_size, c.kv_channels, c.num_attention_heads // a.tp, c.ffn_hidden_size // a.tp
    local = s // t if a.sp else s
    block_input = (s if first_of_model else local) * b * h * e
    saved = _norm("input_layernorm", "rms_norm", local * b, h, e, block_input)
    saved += [Saved("self_attention", "qkv input", local * b * h * e),
              Saved("self_attention", "rope cos, sin of q and k", 4 * s * d * e),
              Saved("self_attention", "q, k, v (k and v repeated per head)", 3 * b * heads * s * d * e)]
    saved += _core_attention(a, b, heads, s, d, masked=True)
    saved += _norm("pre_mlp_layernorm", "rms_norm", local * b, h, e, local * b * h * e)
    saved += [Saved("mlp", "fc1 input", local * b * h * e),
              Saved("mlp", "fc1 output (SwiGLU input)", s * b * 2 * ffn * e)]
    if not a.recompute_activation:  # unfused SwiGLU: silu(x1), x2 + offset, their product (fc2 input)
        saved.append(Saved("mlp", "SwiGLU intermediates and output", 3 * s * b * ffn * e))
    return saved


def vision_layer_saved(c: InternVLConfig, a: Activations) -> list[Saved]:
    """One InternViT layer on all the micro-batch's tiles (a tile is a sequence of 1 + patches tokens; no SP). The
    qkv output is one storage (v, and q and k without QK-norm, are views of it); the 6B class's QK-norm keeps per q
    and k its fp32 rows, rstd, normalised rows and output; layer scale keeps its input."""
    t, e, s = a.tp, a.element, c.patches_per_side**2 + 1
    tokens, h = s * a.tiles, c.vision_hidden_size
    local_h, heads = h // t, c.vision_num_heads // t
    saved = _norm("input_layernorm", c.vision_norm, tokens, h, e, tokens * h * e)
    saved += [Saved("self_attention", "qkv input", tokens * h * e),
              Saved("self_attention", "qkv output", tokens * 3 * local_h * e)]
    if c.vision_qk_norm:
        saved += [Saved("self_attention", "QK-norm of q and k", 2 * tokens * (local_h * (4 + 2 * e) + 4))]
    saved += _core_attention(a, a.tiles, heads, s, h // c.vision_num_heads, masked=False)
    saved.append(Saved("self_attention", "layer scale input", tokens * h * e))
    saved += _norm("pre_mlp_layernorm", c.vision_norm, tokens, h, e, tokens * h * e)
    ffn = c.vision_ffn_hidden_size // t
    saved += [Saved("mlp", "fc1 input", tokens * h * e), Saved("mlp", "GELU input", tokens * ffn * e),
              Saved("mlp", "layer scale input", tokens * h * e)]
    if not a.recompute_activation:
        saved.append(Saved("mlp", "GELU output (fc2 input)", tokens * ffn * e))
    return saved


def placed(saved: list[Saved], a: Activations, first_of_block: bool = False,
           last_of_block: bool = False) -> tuple[int, int]:
    """(device, host) bytes of a layer's saved storages. --swap-attention moves its modules' storages of at least
    --swap-min-bytes to host memory, but the block's first layer's input, which its caller still holds; under
    --swap-select bandwidth (the default) the block's last layer moves nothing (an upper bound of what moves: see
    Activations). Full recompute keeps only the layer's input (see full_recompute_bytes)."""
    swaps = a.swap_attention and not (last_of_block and a.swap_select == "bandwidth")
    device = host = 0
    for item in saved:
        moves = (swaps and item.module in SWAPPED and item.nbytes >= a.swap_min_bytes
                 and not (first_of_block and item.layer_input))
        host += item.nbytes if moves else 0
        device += 0 if moves else item.nbytes
    return device, host


def full_recompute_bytes(c: InternVLConfig, a: Activations, language_layers: int, vision: bool,
                         first_of_model: bool = False) -> int:
    """--recompute-granularity full (uniform, 1 layer): each layer keeps its input ([s / TP under SP, b, h]; the
    model's first layer the whole embedding storage), InternViT's [1 + patches, tiles, vision hidden], and the
    language block its rope table ([s, 1, 1, head dim] fp32) once."""
    t, b, s, e = a.tp, a.micro_batch, a.seq_length, a.element
    local = (s // t if a.sp else s) * b * c.hidden_size * e
    out = language_layers * local + (s * b * c.hidden_size * e - local if first_of_model and language_layers else 0)
    out += s * c.kv_channels * 4 if language_layers else 0
    if vision:
        out += c.vision_layers_run * (c.patches_per_side**2 + 1) * a.tiles * c.vision_hidden_size * e
    return out


def stage_activations(c: InternVLConfig, a: Activations, split: list[int], stage: int) -> tuple[int, int]:
    """(device, host) bytes the transformer layers of one rank of `stage` keep for one micro-batch: its language
    layers and, on the first stage, InternViT's (the layers it runs). Under --swap-select bandwidth the stage's last
    language layer and InternViT's last layer keep theirs on the device."""
    first = stage == 0
    if a.full_recompute:
        return full_recompute_bytes(c, a, split[stage], first and not a.frozen_vision, first_of_model=first), 0
    device = host = 0
    for index in range(split[stage]):
        d, h = placed(language_layer_saved(c, a, first_of_model=first and index == 0), a, index == 0,
                      index == split[stage] - 1)
        device, host = device + d, host + h
    vision = c.vision_layers_run if first and a.tiles and not a.frozen_vision else 0
    for index in range(vision):
        d, h = placed(vision_layer_saved(c, a), a, index == 0, index == vision - 1)
        device, host = device + d, host + h
    return device, host


def in_flight(split: list[int], stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations a 1F1B stage holds at once: PP - stage (at most the step's micro-batches)."""
    return min(len(split) - stage, micro_batches)


ACTIVATION_SETTINGS = {
    "unpatched": {},
    "--use-flash-attn": {"flash_attn": True},
    "+ --recompute-activation-function": {"flash_attn": True, "recompute_activation": True},
    "+ --swap-attention": {"flash_attn": True, "recompute_activation": True, "swap_attention": True},
    "full recompute": {"full_recompute": True},
}


def activation_table(c: InternVLConfig, layouts: dict, base: Activations, micro_batches: int) -> str:
    """Per layout (tp, split, dp), InternViT trained or frozen, and activation setting: the fullest rank's model
    state (distributed optimizer) plus its layers' activations for the micro-batches 1F1B keeps in flight, device GB
    (+ host GB) [its stage]."""
    lines = ["| layout | InternViT | " + " | ".join(ACTIVATION_SETTINGS) + " |",
             "|---|---|" + "---|" * len(ACTIVATION_SETTINGS)]
    for (name, (tp, split, dp)), frozen in ((layout, frozen) for layout in layouts.items() for frozen in (False, True)):
        cells = []
        for kwargs in ACTIVATION_SETTINGS.values():
            a = dataclasses.replace(base, tp=tp, sp=tp > 1, frozen_vision=frozen, **kwargs)
            totals = []
            for stage in range(len(split)):
                state = rank_state(c, tp, split, dp, stage=stage, frozen_vision=frozen)
                device, host = stage_activations(c, a, split, stage)
                flight = in_flight(split, stage, micro_batches)
                totals.append((state.device_bytes + flight * device, flight * host, stage))
            device, host, stage = max(totals)
            cells.append(f"{device / GB:.1f}" + (f" (+{host / GB:.1f} host)" if host else "") + f" [stage {stage}]")
        lines.append(f"| {name} | {'frozen' if frozen else 'trained'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# docs/memory.md's activation tables: seq 4096, micro-batch 1, 13 tiles of 448 px (12 + the thumbnail), bf16, and
# at least PP micro-batches a step (1F1B's steady state)
TABLE_ACTIVATIONS = Activations(seq_length=4096, micro_batch=1, tiles=13)
TABLE_MICRO_BATCHES = 64


def main() -> None:
    """Prints docs/memory.md's InternVL tables: `python -m mm_adaptor.models.internvl.memory`."""
    layouts = {"TP1 PP16 [1, 5 x 14, 9] DP8": (1, [1] + [5] * 14 + [9], 8),
               "TP1 PP15 [1, 6 x 13, 1] DP8": (1, [1] + [6] * 13 + [1], 8),
               "TP1 PP15 [1, 6 x 13, 1] DP32": (1, [1] + [6] * 13 + [1], 32)}
    for name, config in (("InternVL2.5-78B", internvl2_5_78b()), ("110B-class", internvl_110b_class())):
        print(f"### {name}\n\n{markdown_table(config, layouts)}\n")
    for name, config in (("InternVL2.5-78B", internvl2_5_78b()), ("110B-class", internvl_110b_class())):
        print(f"### {name}: model state and activations\n\n"
              f"{activation_table(config, layouts, TABLE_ACTIVATIONS, TABLE_MICRO_BATCHES)}\n")


if __name__ == "__main__":
    main()
