"""--moe-tp-extend-ep: MindSpeed's flag. The tensor-parallel ranks split the experts between them instead of slicing
every expert's matrices: megatron-core's own expert tensor-parallel size 1 with an expert-parallel group TP times
larger. Nothing is patched: the feature is Megatron's arguments rewritten before Megatron checks and builds its
layout (Feature.megatron_arguments); attention stays TP-sliced."""

from mm_adaptor.core.features import Feature, Flag, fused_kernel_tolerance, register, users_value
from mm_adaptor.core.verification import BASE_RELEASE, NO_GPU, ON_0_19_2, TP2_EXTENDED, fake_npu_check, \
    same_everywhere

MAIN = "--moe-tp-extend-ep"
ETP, EP, TP = "--expert-tensor-parallel-size", "--expert-model-parallel-size", "--tensor-model-parallel-size"


@register
class MoETpExtendEp(Feature):
    name = "moe-tp-extend-ep"
    description = (f"the tensor-parallel ranks hold whole experts, split between them, instead of a slice of every "
                   f"expert: megatron-core's {ETP} 1 and {EP} TP x the given {EP} (the expert-parallel group spans "
                   f"the tensor-parallel ranks), attention and the dense layers still TP-sliced; no code is patched")
    flags = (Flag(MAIN, description),)
    tolerance = fused_kernel_tolerance(
        "each expert's matrix products are whole on one rank instead of summed over TP slices (fc2's partial sums "
        "no longer reduced across the tensor-parallel ranks): the same math, another rounding")
    regroups_experts = True
    changes_parameter_layout = True  # whole experts initialise differently: both runs start from one checkpoint
    verified_on = {"0.16.1": BASE_RELEASE, "0.19.0": ON_0_19_2}
    devices = same_everywhere(NO_GPU, fake_npu_check(TP2_EXTENDED))
    refusal_probes = (
        ("TP 1: nothing to extend", {"moe_tp_extend_ep": True, "num_experts": 4, "tensor_model_parallel_size": 1}),
        ("a model without experts", {"moe_tp_extend_ep": True, "tensor_model_parallel_size": 2,
                                     "sequence_parallel": True}),
        ("an expert tensor-parallel size of its own", {"moe_tp_extend_ep": True, "num_experts": 4,
                                                       "tensor_model_parallel_size": 2, "sequence_parallel": True,
                                                       "expert_tensor_parallel_size": 2}),
        ("experts that do not divide over TP x EP", {"moe_tp_extend_ep": True, "num_experts": 6,
                                                     "tensor_model_parallel_size": 2, "sequence_parallel": True,
                                                     "expert_model_parallel_size": 2}),
    )

    def __init__(self):
        self.num_experts = None

    def validate(self, options):
        from mm_adaptor.core.features import FeatureConfigError

        refusal = refusal_for(options)
        if refusal:
            raise FeatureConfigError(refusal)

    def megatron_arguments(self, options) -> dict:
        return {} if refusal_for(options) else megatron_values(options)

    def patch_sets(self, options):
        self.num_experts = getattr(options, "num_experts", None)
        return []  # megatron-core serves the layout itself: megatron_arguments is the whole feature

    def statistics(self):
        """The expert layout megatron built in this process (the check shows the mapping took effect)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return None
        ep = ps.get_expert_model_parallel_world_size()
        stats = {"expert tensor-parallel size": ps.get_expert_tensor_parallel_world_size(),
                 "expert-parallel size": ep}
        if self.num_experts:
            stats["local experts"] = self.num_experts // ep
        return stats


def megatron_values(options) -> dict:
    """Megatron's arguments for TP t and the user's EP e (MindSpeed's meaning: experts spread over e groups of t
    ranks): expert tensor parallelism 1, expert parallelism t x e."""
    tp = getattr(options, "tensor_model_parallel_size", 1) or 1
    ep = users_value(options, "expert_model_parallel_size") or 1
    return {"expert_tensor_parallel_size": 1, "expert_model_parallel_size": tp * ep}


def expert_parallel_size(options) -> int:
    """Megatron's expert-parallel size once this feature expressed itself (before or after the rewrite)."""
    ep = users_value(options, "expert_model_parallel_size") or 1
    if getattr(options, "moe_tp_extend_ep", False):
        return (getattr(options, "tensor_model_parallel_size", 1) or 1) * ep
    return ep


def expert_tensor_parallel_size(options) -> int:
    """Megatron's expert tensor-parallel size once this feature expressed itself (before or after the rewrite)."""
    if getattr(options, "moe_tp_extend_ep", False):
        return 1
    return getattr(options, "expert_tensor_parallel_size", None) or getattr(options, "tensor_model_parallel_size", 1)


def refusal_for(options) -> str | None:
    """One line naming the flags that cannot work together, or None (the user's values: users_value)."""
    if not getattr(options, "moe_tp_extend_ep", False):
        return None
    tp = getattr(options, "tensor_model_parallel_size", 1) or 1
    ep = users_value(options, "expert_model_parallel_size") or 1
    etp = users_value(options, "expert_tensor_parallel_size")
    experts = getattr(options, "num_experts", None)
    if tp == 1:
        return (f"{MAIN} spreads the experts over the tensor-parallel ranks, and {TP} is 1 (nothing to extend): "
                f"give {TP} 2 or more, or drop {MAIN}")
    if not experts:
        return f"{MAIN} acts on MoE layers and the model has none: add --num-experts or drop {MAIN}"
    if etp is not None and etp != 1:
        return (f"{MAIN} sets megatron's {ETP} to 1 (whole experts on each rank), and {ETP} {etp} asks to slice "
                f"them: drop {ETP} or drop {MAIN}")
    if experts % (tp * ep):
        return (f"--num-experts {experts} does not divide over {TP} {tp} x {EP} {ep} = {tp * ep} expert-parallel "
                f"ranks under {MAIN}: use a multiple of {tp * ep} experts")
    if not getattr(options, "sequence_parallel", False):
        return (f"{MAIN} keeps attention TP-sliced, and megatron-core trains MoE layers under {TP} {tp} only with "
                f"--sequence-parallel: add --sequence-parallel")
    return None
