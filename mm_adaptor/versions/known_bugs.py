"""Layouts an installed megatron-core accepts and then trains wrongly without a word: refused in one line that names
the release with the fix. The adaptor is verified against unpatched megatron, so it refuses rather than ports."""

from __future__ import annotations

from packaging.version import Version

from mm_adaptor.versions import contracts

# megatron-core < 0.19 marks expert weights for the expert process groups only under expert parallelism
# (tensor_parallel.layers: allreduce = not (is_expert and expert_model_parallel_size > 1)). With EP 1 and an expert
# tensor-parallel size other than TP, the experts' gradients are reduced over the dense data-parallel ranks alone:
# each tensor-parallel rank keeps the gradient of its own tokens, and the experts' replicas drift apart.
# Fixed in 0.19 (NVIDIA/Megatron-LM #5916, "Fix gradient-norm undercounting when using EP and TP").
EXPERT_GROUPS_FIXED_IN = (0, 19)


def expert_gradient_problem(tp: int, ep: int, etp: int | None, version: str | None = None) -> str | None:
    """The refusal for megatron's expert sizes (etp None: megatron's default, the TP size), or None."""
    if etp is None or etp == tp or ep > 1:
        return None
    version = version or contracts.installed_version()
    if version is None or Version(version).release[:2] >= EXPERT_GROUPS_FIXED_IN:
        return None
    return (f"megatron-core {version} does not sum the experts' gradients over the tensor-parallel ranks when the "
            f"expert tensor-parallel size ({etp}) differs from --tensor-model-parallel-size {tp} under expert-"
            f"parallel size 1, so their copies drift apart (fixed in megatron-core 0.19, NVIDIA/Megatron-LM #5916): "
            f"use --expert-model-parallel-size > 1, --expert-tensor-parallel-size {tp}, or megatron-core >= 0.19")


def layout_problem(args) -> str | None:
    """The refusal for a parsed namespace (Megatron-LM's after its validation, or the harness's), or None: Megatron's
    defaults for the sizes it lacks."""
    if not getattr(args, "num_experts", None):
        return None
    return expert_gradient_problem(getattr(args, "tensor_model_parallel_size", 1),
                                   getattr(args, "expert_model_parallel_size", 1),
                                   getattr(args, "expert_tensor_parallel_size", None))
