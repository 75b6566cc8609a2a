"""The converter's view of a model family: a list of rules, each joining one Megatron tensor to the Hugging Face
tensors it is made of, and the pure functions that go from one side to the other.

A rule names its Megatron state-dict name and its HF names with `{i}` standing for a layer index of a layer stack
("llm" or "vit"); the family says how many layers each stack has, and which layers a partial stack covers
(`subsets`: a MoE model's dense and MoE layers). Operations:

- copy:      one HF tensor, the same tensor in Megatron.
- qkv:       HF q, k, v (separate projections, grouped-query) -> Megatron's linear_qkv, whose rows are grouped by
             key/value group: [q of the group's heads, k, v] for group 0, then group 1, ... (what megatron's
             SelfAttention splits a fused projection into). Weights and biases alike.
- qkv_fused: one HF [q; k; v] tensor (a vision block's `qkv`) -> the same grouping, one group per head.
- cat:       HF parts concatenated along dim 0 (gate, up -> linear_fc1, which megatron's swiglu splits in halves).
- reshape:   one HF tensor viewed in another shape (a Conv3d kernel as a Linear weight); the family gives the shape.
- shared:    one Megatron tensor that every HF part equals (the A factor of a LoRA adapter on a fused linear, shared
             by HF's q/k/v or gate/up); parts that differ are refused.

Experts (megatron-core MoE, SequentialMLP): one rule per expert, its Megatron name `...mlp.experts.local_experts.
<e>.linear_fc1.weight` and its HF names the expert's own (`...mlp.experts.<e>.gate_proj.weight`, ...); a rule may say
`{e}` instead, expanded over `stacks["experts"]` experts. In the dist checkpoint every expert of a layer shares one
key (`...mlp.experts.experts.linear_fc1.weight`) with the global expert number as an axis after the layer's, which
is why a checkpoint is the same for any expert-parallel size. transformers keeps all experts of a layer in fused
tensors instead (`FusedExperts`, `fuse_experts` / `split_experts`), whose layout depends on its major version.

Everything here works on meta tensors too, so a 72B layout is checked without memory. A family's table comes from
its model package (`mm_adaptor/models/<family>/mapping.py`, found through families.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

OPS = ("copy", "qkv", "qkv_fused", "cat", "reshape", "shared")
EXPERTS = "experts"  # the stack `{e}` ranges over
# megatron's TransformerLayer (local spec) stores its norms under the names TE's fused linear layers give them
LAYER_KEYS_MAP = {"layers.{i}.input_layernorm.": "layers.{i}.self_attention.linear_qkv.layer_norm_",
                  "layers.{i}.pre_mlp_layernorm.": "layers.{i}.mlp.linear_fc1.layer_norm_"}
MCORE_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
HF_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<part>[^.]+)\.weight$")


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
        if ("{e}" in self.mcore) and not (self.stack and all("{e}" in name for name in self.hf)):
            raise ValueError(f"rule for {self.mcore}: {{e}} needs a layer stack and {{e}} in every HF name")

    @property
    def expert(self) -> int | None:
        """The global expert number of an expert's rule (its `local_experts.<e>.`), else None."""
        found = MCORE_EXPERT.search(self.mcore)
        return int(found[1]) if found else None

    def key_template(self) -> str:
        """The dist-checkpoint key with `{i}.` where the layer number goes: a TransformerLayer's norms under their TE
        names (its sharded_state_dict_keys_map), an expert under the layer's `experts.` (SequentialMLP's)."""
        key = MCORE_EXPERT.sub(".experts.", self.mcore)
        for old, new in LAYER_KEYS_MAP.items():
            key = key.replace(old, new)
        return key

    def sharded_key(self) -> str:
        """The key megatron's dist_checkpointing stores the tensor under when its stack is saved as one: a layer
        stack's tensors share one key (`decoder.layers.self_attention.linear_qkv.weight`) with the global layer
        index as a leading axis (and an expert's, the global expert number as the next)."""
        return self.key_template().replace("{i}.", "")

    def hf_names(self, layer: int | None = None) -> list[str]:
        return [name.format(i=layer) if layer is not None else name for name in self.hf]

    def mcore_name(self, layer: int | None = None) -> str:
        return self.mcore.format(i=layer) if layer is not None else self.mcore

    def for_expert(self, expert: int) -> Rule:
        """This `{e}` rule for one expert."""
        name = lambda text: text.replace("{e}", str(expert))  # noqa: E731
        return Rule(name(self.mcore), tuple(map(name, self.hf)), self.op, self.stack, self.qkv, self.shape,
                    self.hf_shape)


@dataclass(frozen=True)
class FusedExperts:
    """transformers' fused experts: `<prefix>.experts.<name>` holds, for every expert of the layer, the Linear weights
    `<prefix>.experts.<e>.<part>.weight` of `parts` joined along their output dim. transformers 4.x stores each
    expert's block as x @ W wants it, (E, in, out); 5.x as Linear weights, (E, out, in)."""

    name: str
    parts: tuple[str, ...]


# Qwen3-VL-MoE's (and transformers' other fused MoE models'): gate and up in one tensor, down in another
TRANSFORMERS_FUSED = (FusedExperts("gate_up_proj", ("gate_proj", "up_proj")), FusedExperts("down_proj", ("down_proj",)))


def split_experts(tensor: torch.Tensor, parts: int, major: int) -> list[list[torch.Tensor]]:
    """A fused experts tensor of the given transformers major version -> per expert, its `parts` Linear weights
    (views)."""
    blocks = tensor.transpose(1, 2) if major < 5 else tensor  # (E, out, in)
    return [list(block.chunk(parts, dim=0)) for block in blocks]


def fuse_experts(per_expert: list[list[torch.Tensor]], major: int) -> torch.Tensor:
    """The inverse of split_experts: per expert its parts' Linear weights -> the fused tensor transformers `major`
    stores (contiguous; filled in place, without a second copy of every expert)."""
    first = per_expert[0]
    rows, cols = sum(part.shape[0] for part in first), first[0].shape[1]
    shape = (len(per_expert), rows, cols) if major >= 5 else (len(per_expert), cols, rows)
    fused = torch.empty(shape, dtype=first[0].dtype, device=first[0].device)
    for e, parts in enumerate(per_expert):
        block, row = (fused[e] if major >= 5 else fused[e].T), 0  # (out, in)
        for part in parts:
            block[row:row + part.shape[0]].copy_(part)
            row += part.shape[0]
    return fused


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
    if rule.op == "shared":
        if any(not torch.equal(part, parts[0]) for part in parts[1:]):
            raise ValueError(f"{rule.mcore}: its parts {', '.join(rule.hf)} differ; one tensor holds them all")
        return parts[0]
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
    elif rule.op == "shared":
        parts = [tensor] * len(rule.hf)
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
    stacks: dict[str, int]  # layers per stack; "experts": the experts per MoE layer that `{e}` ranges over
    # HF names present in some checkpoints that the converter drops (a tied lm_head saved anyway)
    ignored_hf: set[str] = field(default_factory=set)
    # megatron modules with an `_extra_state` (linear layers): name with {i} (and {e}) -> stack or None; saved as None
    # objects
    extra_states: dict[str, str | None] = field(default_factory=dict)
    # HF name prefixes accepted on input and renamed to the saved form (newer in-memory names -> legacy names)
    hf_aliases: dict[str, str] = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # the HF config the family was made from
    # stacks whose rules cover some of the layers only (a MoE model's dense MLP layers, its MoE layers): the layer
    # numbers; stacks[name] stays the length of the whole stack
    subsets: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Megatron name prefixes (a TransformerBlock's `...decoder.layers.`) whose checkpoint keys keep each layer's
    # number: megatron saves a block of non-homogeneous layers (a MoE layer pattern given as a list) layer by layer
    per_layer_keys: tuple[str, ...] = ()
    # how transformers holds this family's experts; () when it keeps one module per expert
    fused_experts: tuple[FusedExperts, ...] = TRANSFORMERS_FUSED
    _indexes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if any("{e}" in rule.mcore for rule in self.rules) or any("{e}" in name for name in self.extra_states):
            if EXPERTS not in self.stacks:
                raise ValueError(f"{self.name}: rules with {{e}} need stacks[{EXPERTS!r}], the number of experts")
            experts = range(self.stacks[EXPERTS])
            self.rules = [expanded for rule in self.rules
                          for expanded in ([rule.for_expert(e) for e in experts] if "{e}" in rule.mcore else [rule])]
            self.extra_states = {name.replace("{e}", str(e)): stack for name, stack in self.extra_states.items()
                                 for e in (experts if "{e}" in name else [None])}

    def canonical_hf(self, name: str) -> str:
        for new, old in self.hf_aliases.items():
            if name.startswith(new):
                return old + name[len(new):]
        return name

    def stack_layers(self, stack: str | None) -> list[int | None]:
        if stack is None:
            return [None]
        return list(self.subsets[stack]) if stack in self.subsets else list(range(self.stacks[stack]))

    def layers(self, rule: Rule) -> list[int | None]:
        return self.stack_layers(rule.stack)

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer (0 without experts): stacks["experts"], else the rules' expert numbers."""
        if EXPERTS in self.stacks:
            return self.stacks[EXPERTS]
        if "experts" not in self._indexes:
            numbers = {rule.expert for rule in self.rules} - {None}
            if numbers and numbers != set(range(len(numbers))):
                raise ValueError(f"{self.name}: the rules' experts {sorted(numbers)} are not numbered 0 to N - 1")
            self._indexes["experts"] = len(numbers)
        return self._indexes["experts"]

    def hf_index(self) -> dict[str, tuple[Rule, int | None, int]]:
        """Every HF name -> (rule, layer, position among the rule's parts)."""
        if "hf" not in self._indexes:
            index = {}
            for rule in self.rules:
                for layer in self.layers(rule):
                    for position, name in enumerate(rule.hf_names(layer)):
                        index[name] = (rule, layer, position)
            self._indexes["hf"] = index
        return self._indexes["hf"]

    def by_sharded_key(self) -> dict[str, Rule]:
        return {rule.sharded_key(): rule for rule in self.rules}

    # ---- where each tensor sits in the dist checkpoint ----

    def _placement(self, template: str, stack: str | None, layer: int | None, expert: int | None):
        offsets, totals = [], []
        if layer is not None:
            if self.per_layer_keys and template.startswith(self.per_layer_keys):
                template = template.format(i=layer)
            else:
                template = template.replace("{i}.", "")
                offsets.append(layer)
                totals.append(self.stacks[stack])
        if expert is not None:
            offsets.append(expert)
            totals.append(self.num_experts)
        return template, tuple(offsets), tuple(totals)

    def placement(self, rule: Rule, layer: int | None) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """(key, offsets, totals): the tensor is the chunk at `offsets` of the key's leading axes, whose sizes are
        `totals` (the layer axis of a stack saved as one, then the expert axis; neither for a plain tensor)."""
        return self._placement(rule.key_template(), rule.stack, layer, rule.expert)

    def object_placements(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """The linear layers' `_extra_state` objects as (key, offsets, totals), in the order of extra_states."""
        out = []
        for name, stack in self.extra_states.items():
            found = MCORE_EXPERT.search(name)
            template = MCORE_EXPERT.sub(".experts.", name)
            for layer in self.stack_layers(stack):
                out.append(self._placement(template, stack, layer, int(found[1]) if found else None))
        return out

    def checkpoint_keys(self) -> dict[str, tuple[int, ...]]:
        """Every tensor key of the dist checkpoint -> the sizes of its leading (layer, expert) axes."""
        return {key: totals for rule in self.rules for layer in self.layers(rule)
                for key, _, totals in [self.placement(rule, layer)]}

    # ---- transformers' fused experts ----

    def fused_index(self) -> dict[str, tuple[FusedExperts, list[str]]]:
        """Every fused experts name transformers may use for this family -> (its FusedExperts, the per-expert HF
        names it holds, expert by expert, the parts in order)."""
        if "fused" in self._indexes:
            return self._indexes["fused"]
        experts: dict[str, dict[int, set[str]]] = {}
        for name in self.hf_index():
            found = HF_EXPERT.match(name)
            if found:
                experts.setdefault(found["prefix"], {}).setdefault(int(found["e"]), set()).add(found["part"])
        index = {}
        for prefix, parts_of in experts.items():
            for fused in self.fused_experts:
                if all(set(fused.parts) <= parts for parts in parts_of.values()):
                    index[f"{prefix}.{fused.name}"] = (fused, [f"{prefix}.{e}.{part}.weight" for e in sorted(parts_of)
                                                               for part in fused.parts])
        self._indexes["fused"] = index
        return index

    def expand_fused(self, names) -> list[str]:
        """HF names with each fused experts name replaced by the per-expert names it holds."""
        index = self.fused_index()
        return [held for name in names for held in (index[name][1] if name in index else [name])]
