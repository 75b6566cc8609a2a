"""A deliberately wrong --recompute-activation-function, registered only for the harness's self-test (loaded into
the training ranks through MM_ADAPTOR_FEATURE_MODULES): it releases the activation's output like the real feature,
but recomputes it from an input one ulp larger (in its own dtype: x * 1.001 vanishes in bf16) before refilling
the storage. It claims bit-for-bit and must fail, in fp32 and bf16."""

import functools

import torch

from mm_adaptor.versions import contracts
from mm_adaptor.core.features import BIT_FOR_BIT, Feature, Flag, register


def _perturbed_checkpoint_class():
    from megatron.core.tensor_parallel import CheckpointWithoutOutput

    class RecomputesFromAPerturbedInput(CheckpointWithoutOutput):
        def _recompute(self, grad):
            if self.run_function is not None:
                right = self.run_function
                self.run_function = lambda x, *rest: right(torch.nextafter(x, torch.full_like(x, float("inf"))), *rest)
            return super()._recompute(grad)

    return RecomputesFromAPerturbedInput


@register
class RecomputeActivationFromPerturbedInput(Feature):
    name = "test-recompute-activation-perturbed"
    description = "recomputes the released MLP activation from its input one ulp larger, claiming bit-for-bit"
    flags = (Flag("--use-test-recompute-activation-perturbed", description),)
    tolerance = BIT_FOR_BIT

    def patch_sets(self, options):
        from mm_adaptor.patches.transformer import recompute_activation as rc
        from mm_adaptor.patches.transformer.hybrid_stack import HYBRID_STACK, wrap_where_defined
        from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet

        ps = PatchSet(self.name)
        ps.wrap("megatron.core.transformer.transformer_block.TransformerBlock.__init__",
                rc.block_init_marking_layers(None))
        ps.wrap("megatron.core.transformer.mlp.MLP.forward",
                functools.partial(rc.mlp_forward_recomputing_activation,
                                  checkpoint_class=_perturbed_checkpoint_class()))
        # a HybridModel's MLP layers are marked by its stack, as the real feature marks them (megatron-core 0.18+)
        wrap_where_defined(ps, f"{HYBRID_STACK}.__init__", rc.stack_init_marking_layers(None),
                           Contract(versions=SUPPORTED_MEGATRON_CORE))
        return [ps]


contracts.verified_like(RecomputeActivationFromPerturbedInput.name, "recompute-activation-function")
