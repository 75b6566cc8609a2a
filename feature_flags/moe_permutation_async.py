"""--moe-permutation-async-comm: MindSpeed's flag. On a device with streams (CUDA, NPU), megatron's MoE token
permutation and unpermutation run on a side stream of the backend, with the stream waits and record_stream the
caching allocator needs; on the CPU, whose streams are ordered no-ops, it does nothing, says so in one line, and its
statistics record it (patches/transformer/moe_permutation_async.py)."""

import warnings
from collections import Counter

from mm_adaptor.core.features import Feature, Flag, Tolerance, refuse_unless_local_spec, register
from mm_adaptor.core.verification import BASE_RELEASE, NO_GPU, ON_0_19_2, EP2_OVERLAP, fake_npu_check, \
    same_everywhere

MAIN = "--moe-permutation-async-comm"
TARGETS = ("megatron.core.transformer.moe.moe_utils.permute", "megatron.core.transformer.moe.moe_utils.unpermute")


@register
class MoEPermutationAsync(Feature):
    name = "moe-permutation-async-comm"
    verified_on = {"0.16.1": BASE_RELEASE, "0.19.0": ON_0_19_2}
    devices = same_everywhere("the side-stream path never ran on a GPU; " + NO_GPU,
                              fake_npu_check(EP2_OVERLAP + " (the fake's streams are synchronous)"),
                              cpu="a recorded no-op on the CPU backend (no side streams), checked bit for bit in CI "
                                  "(tests/distributed)")
    refusal_probes = (
        ("a model without experts", {"moe_permutation_async_comm": True}),
    )
    description = ("megatron's MoE token permutation and unpermutation run on a side stream (CUDA, NPU), the "
                   "current stream waiting for them before their outputs are used; a no-op on the CPU, which has "
                   "no streams (one line says so)")
    flags = (Flag(MAIN, description),)
    tolerance = Tolerance(exact=True, why="the same permutation kernels on the same inputs, on another stream")

    def __init__(self):
        self.counts = Counter()

    def statistics(self):
        return dict(self.counts) or None

    def validate(self, options):
        refusal = None
        if not getattr(options, "num_experts", None):
            refusal = (f"{MAIN} moves MoE token permutations to a side stream and the model has none: add "
                       f"--num-experts or drop {MAIN}")
        refuse_unless_local_spec(self, options, refusal)

    def patch_sets(self, options):
        from mm_adaptor import devices
        from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet
        from mm_adaptor.patches.transformer import moe_permutation_async as pa

        backend = devices.current()  # None: listing the patches (scripts/fingerprint_megatron.py), not a run
        if backend is not None and backend.name == "cpu":
            self.counts["side streams"] = "none on cpu: a no-op"
            warnings.warn(f"{MAIN} does nothing on the CPU backend (no side streams): megatron's permutation runs "
                          f"as without it", RuntimeWarning, stacklevel=2)
            return []
        side = pa.SidePermutation(self.counts)
        contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
        ps = PatchSet(self.name)
        for target in TARGETS:
            ps.wrap(target, side.wrapper(target.rsplit(".", 1)[1]), contract=contract)
        return [ps]
