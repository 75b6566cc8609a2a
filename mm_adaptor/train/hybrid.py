"""--hybrid-layer-pattern: megatron-core's HybridModel (0.18 and newer) instead of GPTModel.

A HybridModel's decoder (HybridStack) is one layer per pattern symbol: '*' self-attention (a TransformerLayer with
only its attention half), '-' a dense MLP (MLPLayer, a TransformerLayer with only its MLP half), 'E' an MoE layer
(MoETransformerLayer); '|' marks pipeline segments (with more segments than pipeline stages, each stage holds
segments / stages virtual stages). So '*-*-' is the layers of a two-layer GPT, split into four.

Megatron's only hybrid spec builds on Transformer Engine (and its HybridStack always builds Transformer Engine's
final norm); the driver builds the same layers from megatron's local GPT spec (so the local-spec features see the
same modules as in the GPT) and the final norm the GPT's TransformerBlock builds. Mamba ('M'), gated delta net
('G'), DeepSeek sparse attention ('D'), MLA ('+') and multi-token prediction ('/') are refused in one line.

Validation imports neither torch nor megatron."""

from __future__ import annotations

import argparse
import importlib.util
import os

FLAG = "--hybrid-layer-pattern"
ATTENTION, MLP, MOE, PIPE = "*", "-", "E", "|"
BUILT = {ATTENTION: "attention", MLP: "MLP", MOE: "MoE"}
# Symbols megatron knows that the driver does not build, and why.
NOT_BUILT = {
    "M": "Mamba",
    "G": "gated delta net",
    "D": "DeepSeek sparse attention",
    "+": "multi-latent attention",
}
NEEDS_PACKAGE = {"M": ("mamba_ssm", "mamba-ssm"), "G": ("fla", "flash-linear-attention")}
MTP = "/"


def available() -> bool:
    """Whether the installed megatron-core has HybridModel (megatron.core.models.hybrid, 0.18 and newer); looked
    up on disk, without importing megatron."""
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return False
    locations = getattr(spec, "submodule_search_locations", None) or []
    return any(os.path.isfile(os.path.join(p, "core", "models", "hybrid", "hybrid_model.py")) for p in locations)


def _installed_megatron_core() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def unavailable() -> str:
    return (f"{FLAG} needs megatron-core 0.18 or newer (HybridModel, megatron.core.models.hybrid); megatron-core "
            f"{_installed_megatron_core()} is installed: drop {FLAG} or upgrade megatron-core")


def segments(pattern: str) -> list[str]:
    return pattern.split(PIPE)


def layer_count(pattern: str) -> int:
    return len(pattern.replace(PIPE, ""))


def _has_package(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def pattern_problem(pattern: str) -> str | None:
    """One line on a pattern the driver cannot build, or None."""
    shown = f"{FLAG} {pattern!r}"
    if not pattern.replace(PIPE, ""):
        return f"{shown} has no layer: give one symbol per layer, e.g. '*-*-' (attention, MLP, attention, MLP)"
    if MTP in pattern:
        return (f"{shown}: multi-token prediction ('/' and the pattern after it) is not built by the driver: "
                "drop the '/' part")
    for symbol in dict.fromkeys(pattern.replace(PIPE, "")):
        if symbol in BUILT:
            continue
        if symbol in NOT_BUILT:
            what = f"'{symbol}' ({NOT_BUILT[symbol]}) layers"
            module, package = NEEDS_PACKAGE.get(symbol, (None, None))
            if module and not _has_package(module):
                return (f"{shown}: {what} need the {package} package ({module}, CUDA kernels), which is not installed, "
                        "and mm_adaptor builds only '*' (attention), '-' (MLP) and 'E' (MoE) layers: use those, or "
                        "train this pattern with Megatron-LM's pretrain_hybrid.py")
            return (f"{shown}: {what} are not built by mm_adaptor, only '*' (attention), '-' (MLP) and 'E' (MoE) "
                    "(megatron's spec for the others needs Transformer Engine): use those, or train this pattern "
                    "with Megatron-LM's pretrain_hybrid.py")
        return (f"{shown}: {symbol!r} is not a layer symbol: use '*' (attention), '-' (MLP), 'E' (MoE) and '|' "
                "between pipeline segments")
    if any(not part for part in segments(pattern)):
        return f"{shown} has an empty pipeline segment ('|' at an end or '||'): put layers between every two '|'"
    return None


def problems(args: argparse.Namespace) -> list[str]:
    """Every problem of --hybrid-layer-pattern with the other flags (one line each); sets args.num_layers to the
    pattern's layer count, as Megatron-LM does (--num-layers is ignored). A megatron-core without HybridModel, or
    a pattern the driver cannot build, is the only problem reported then."""
    pattern = args.hybrid_layer_pattern
    if not available():
        return [unavailable()]
    problem = pattern_problem(pattern)
    if problem:
        return [problem]
    found = []
    pp = args.pipeline_model_parallel_size
    parts = segments(pattern)
    if args.num_layers_per_virtual_pipeline_stage is not None:
        found.append(f"--num-layers-per-virtual-pipeline-stage does not apply to {FLAG}: mark the virtual pipeline "
                     f"stages with '|' in the pattern (e.g. '*-|*-|*-|*-' with --pipeline-model-parallel-size 2 gives "
                     "2 virtual stages per stage)")
    if len(parts) > 1:
        if pp < 2:
            found.append(f"{FLAG} {pattern!r} has {len(parts)} pipeline segments ('|') but "
                         f"--pipeline-model-parallel-size is {pp}: give {len(parts)} (or a divisor of it from 2 up), "
                         "or drop the '|'")
        elif len(parts) % pp != 0:
            found.append(f"{FLAG} {pattern!r} has {len(parts)} pipeline segments, not divisible by "
                         f"--pipeline-model-parallel-size {pp}: give a multiple of {pp} segments")
    elif pp > 1 and layer_count(pattern) % pp != 0:
        found.append(f"{FLAG} {pattern!r} has {layer_count(pattern)} layers, not divisible by "
                     f"--pipeline-model-parallel-size {pp}: mark the stages with '|' or use a multiple of {pp} layers")
    has_moe = MOE in pattern
    if has_moe and not args.num_experts:
        found.append(f"{FLAG} {pattern!r} has 'E' (MoE) layers, which need --num-experts: add it")
    if args.num_experts and not has_moe:
        found.append(f"--num-experts {args.num_experts} with {FLAG} {pattern!r}: only 'E' layers have experts and the "
                     "pattern has none: add 'E' layers or drop --num-experts")
    args.num_layers = layer_count(pattern)
    return found


def virtual_stages(args: argparse.Namespace) -> int | None:
    """The virtual pipeline size the pattern's '|' segments give (None: one segment per stage or none)."""
    pp = args.pipeline_model_parallel_size
    count = len(segments(args.hybrid_layer_pattern))
    return count // pp if count > 1 and pp > 1 and count % pp == 0 and count > pp else None


def layers_per_stage(args: argparse.Namespace) -> int:
    """The most layers one pipeline stage holds (all its virtual stages)."""
    pp = args.pipeline_model_parallel_size
    parts = segments(args.hybrid_layer_pattern)
    if len(parts) == 1:
        return layer_count(args.hybrid_layer_pattern) // pp
    return max(sum(len(parts[i]) for i in range(rank, len(parts), pp)) for rank in range(pp))


# ---- building (imports torch and megatron) ----

def _local_stack_class():
    from megatron.core.models.hybrid.hybrid_block import HybridStack
    from megatron.core.transformer import transformer_block

    class LocalNormHybridStack(HybridStack):
        """HybridStack whose final norm is the one the GPT's TransformerBlock builds without Transformer Engine
        (megatron's HybridStack builds Transformer Engine's TENorm unconditionally)."""

        def __init__(self, *args, post_layer_norm: bool = True, **kwargs):
            super().__init__(*args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = transformer_block.LayerNormImpl(
                    config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)

    return LocalNormHybridStack


def local_stack_spec(args):
    """HybridStack spec from megatron's local GPT layer spec: the attention half for '*', the MLP half for '-',
    the MoE MLP half for 'E'."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (MoETransformerLayer, TransformerLayer,
                                                             TransformerLayerSubmodules)

    dense = get_gpt_layer_local_spec(normalization=args.normalization).submodules
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=dense.input_layernorm, self_attention=dense.self_attention,
        self_attn_bda=dense.self_attn_bda))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda))
    submodules = HybridStackSubmodules(attention_layer=attention, mlp_layer=mlp)
    if args.num_experts:
        moe = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
                                       normalization=args.normalization).submodules
        submodules.moe_layer = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda))
    return ModuleSpec(module=_local_stack_class(), submodules=submodules)


def model_factory(args, config):
    """HybridModel with the local stack spec and the pattern; train.model builds one per virtual stage."""
    import functools

    from megatron.core.models.hybrid.hybrid_model import HybridModel

    return functools.partial(HybridModel, config=config, hybrid_stack_spec=local_stack_spec(args),
                             hybrid_layer_pattern=args.hybrid_layer_pattern)


def layer_kinds(chunks) -> dict[str, str]:
    """{"layer N": symbol} for the decoder layers these chunks hold, in order (N: megatron's global layer number,
    as in the memory accounting): what was built, read back from the modules."""
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer

    kinds = {}
    for chunk in chunks:
        while hasattr(chunk, "module"):  # DDP / Float16Module
            chunk = chunk.module
        for layer in chunk.decoder.layers:
            if isinstance(getattr(layer, "mlp", None), MoELayer):
                kind = MOE
            elif isinstance(layer, MLPLayer):
                kind = MLP
            elif not isinstance(getattr(layer, "self_attention", None), IdentityOp):
                kind = ATTENTION
            else:
                kind = "?"
            kinds[f"layer {layer.layer_number}"] = kind
    return kinds
