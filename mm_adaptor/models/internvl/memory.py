"""InternVL's model and optimizer state per rank, from the config's shapes (no model built), for a layout the
user names: TP, uneven PP (InternViT and the projector on the first stage), DP, the distributed optimizer, bf16
with Adam, and the optimizer-state features of docs/memory.md (--reuse-fp32-param, --swap-optimizer,
--virtual-optimizer). Per element of a rank's parameters: 2 B bf16 parameter, 4 B fp32 gradient buffer (DDP's
main_grad); per element of the rank's optimizer shard (all of them, or 1 / DP with the distributed optimizer):
4 B fp32 main parameter (2 B with --reuse-fp32-param), 8 B moments; --swap-optimizer and --virtual-optimizer keep
main parameters and moments in host memory. Activations are not counted here."""

from __future__ import annotations

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


def main() -> None:
    """Prints docs/memory.md's InternVL tables: `python -m mm_adaptor.models.internvl.memory`."""
    layouts = {"TP1 PP16 [1, 5 x 14, 9] DP8": (1, [1] + [5] * 14 + [9], 8),
               "TP1 PP15 [1, 6 x 13, 1] DP8": (1, [1] + [6] * 13 + [1], 8),
               "TP1 PP15 [1, 6 x 13, 1] DP32": (1, [1] + [6] * 13 + [1], 32)}
    for name, config in (("InternVL2.5-78B", internvl2_5_78b()), ("110B-class", internvl_110b_class())):
        print(f"### {name}\n\n{markdown_table(config, layouts)}\n")


if __name__ == "__main__":
    main()
