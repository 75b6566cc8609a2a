"""The converter's view of a model family: a list of rules, each joining one Megatron tensor to the Hugging Face
tensors it is made of, and the pure functions that go from one side to the other.

A rule names its Megatron state-dict name and its HF names with `{i}` standing for a layer index of a layer stack
("llm" or "vit"); the family says how many layers each stack has. Operations:

- copy:      one HF tensor, the same tensor in Megatron.
- qkv:       HF q, k, v (separate projections, grouped-query) -> Megatron's linear_qkv, whose rows are grouped by
             key/value group: [q of the group's heads, k, v] for group 0, then group 1, ... (what megatron's
             SelfAttention splits a fused projection into). Weights and biases alike.
- qkv_fused: one HF [q; k; v] tensor (a vision block's `qkv`) -> the same grouping, one group per head.
- cat:       HF parts concatenated along dim 0 (gate, up -> linear_fc1, which megatron's swiglu splits in halves).
- reshape:   one HF tensor viewed in another shape (a Conv3d kernel as a Linear weight); the family gives the shape.

Everything here works on meta tensors too, so a 72B layout is checked without memory. A family's table comes from
its model package (`mm_adaptor/models/<family>/mapping.py`, found through families.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

OPS = ("copy", "qkv", "qkv_fused", "cat", "reshape")
# megatron's TransformerLayer (local spec) stores its norms under the names TE's fused linear layers give them
LAYER_KEYS_MAP = {"layers.input_layernorm.": "layers.self_attention.linear_qkv.layer_norm_",
                  "layers.pre_mlp_layernorm.": "layers.mlp.linear_fc1.layer_norm_"}


@dataclass(frozen=True)
class Rule:
    mcore: str
    hf: tuple[str, ...]
    op: str = "copy"
    stack: str | None = None  # the layer stack {i} ranges over, None for a tensor outside the layers
    qkv: tuple[int, int, int] | None = None  # (heads, key/value groups, head dim) for qkv and qkv_fused
    shape: tuple[int, ...] | None = None  # Megatron's shape for reshape
    hf_shape: tuple[int, ...] | None = None  # HF's shape for reshape (to_hf's default)

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"rule for {self.mcore}: unknown op {self.op!r} (one of {', '.join(OPS)})")
        if ("{i}" in self.mcore) != (self.stack is not None):
            raise ValueError(f"rule for {self.mcore}: a stack needs {{i}} in the names and {{i}} needs a stack")

    def sharded_key(self) -> str:
        """The key megatron's dist_checkpointing stores the tensor under: a layer stack's tensors share one key
        (`decoder.layers.self_attention.linear_qkv.weight`) with the global layer index as a leading axis, and a
        TransformerLayer's norms are stored under their TE names (its sharded_state_dict_keys_map)."""
        key = self.mcore.replace("{i}.", "")
        for old, new in LAYER_KEYS_MAP.items():
            key = key.replace(old, new)
        return key

    def hf_names(self, layer: int | None = None) -> list[str]:
        return [name.format(i=layer) if layer is not None else name for name in self.hf]

    def mcore_name(self, layer: int | None = None) -> str:
        return self.mcore.format(i=layer) if layer is not None else self.mcore


def _grouped(q, k, v, heads: int, groups: int, head_dim: int):
    rest = q.shape[1:]
    per = heads // groups
    return torch.cat([q.reshape(groups, per * head_dim, *rest), k.reshape(groups, head_dim, *rest),
                      v.reshape(groups, head_dim, *rest)], dim=1).reshape(-1, *rest)


def _ungrouped(t, heads: int, groups: int, head_dim: int):
    rest = t.shape[1:]
    per = heads // groups
    g = t.reshape(groups, (per + 2) * head_dim, *rest)
    q, k, v = torch.split(g, [per * head_dim, head_dim, head_dim], dim=1)
    return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]


def to_mcore(rule: Rule, parts: list[torch.Tensor]) -> torch.Tensor:
    """The Megatron tensor made of the rule's HF parts (in the order of rule.hf)."""
    if rule.op == "copy":
        return parts[0]
    if rule.op == "cat":
        return torch.cat(parts, dim=0)
    if rule.op == "reshape":
        return parts[0].reshape(rule.shape)
    heads, groups, head_dim = rule.qkv
    if rule.op == "qkv":
        return _grouped(*parts, heads, groups, head_dim)
    q, k, v = torch.chunk(parts[0], 3, dim=0)
    return _grouped(q, k, v, heads, groups, head_dim)


def to_hf(rule: Rule, tensor: torch.Tensor, hf_shapes: list[tuple[int, ...]] | None = None) -> list[torch.Tensor]:
    """The HF parts of a Megatron tensor; `hf_shapes` are the parts' shapes (they say how a cat splits and which
    shape a reshape goes back to; by default a cat splits in equal parts and a reshape uses rule.hf_shape). Parts
    are contiguous tensors of their own."""
    if rule.op == "copy":
        parts = [tensor]
    elif rule.op == "cat":
        sizes = [shape[0] for shape in hf_shapes] if hf_shapes else [tensor.shape[0] // len(rule.hf)] * len(rule.hf)
        parts = list(torch.split(tensor, sizes, dim=0))
    elif rule.op == "reshape":
        parts = [tensor.reshape(hf_shapes[0] if hf_shapes else rule.hf_shape)]
    else:
        heads, groups, head_dim = rule.qkv
        parts = _ungrouped(tensor, heads, groups, head_dim)
        if rule.op == "qkv_fused":
            parts = [torch.cat(parts, dim=0)]
    if rule.op == "copy":
        return [tensor.contiguous()]
    return [part.clone(memory_format=torch.contiguous_format) for part in parts]


@dataclass
class Family:
    """One model family under one config: its rules and its layer stacks' sizes."""

    name: str
    rules: list[Rule]
    stacks: dict[str, int]
    # HF names present in some checkpoints that the converter drops (a tied lm_head saved anyway)
    ignored_hf: set[str] = field(default_factory=set)
    # megatron modules with an `_extra_state` (linear layers): name with {i} -> stack or None; saved as None objects
    extra_states: dict[str, str | None] = field(default_factory=dict)
    # HF name prefixes accepted on input and renamed to the saved form (newer in-memory names -> legacy names)
    hf_aliases: dict[str, str] = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # the HF config the family was made from

    def canonical_hf(self, name: str) -> str:
        for new, old in self.hf_aliases.items():
            if name.startswith(new):
                return old + name[len(new):]
        return name

    def layers(self, rule: Rule) -> list[int | None]:
        return list(range(self.stacks[rule.stack])) if rule.stack else [None]

    def hf_index(self) -> dict[str, tuple[Rule, int | None, int]]:
        """Every HF name -> (rule, layer, position among the rule's parts)."""
        index = {}
        for rule in self.rules:
            for layer in self.layers(rule):
                for position, name in enumerate(rule.hf_names(layer)):
                    index[name] = (rule, layer, position)
        return index

    def by_sharded_key(self) -> dict[str, Rule]:
        return {rule.sharded_key(): rule for rule in self.rules}
