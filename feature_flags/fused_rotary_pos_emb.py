"""--use-fused-rotary-pos-emb: megatron's apply_rotary_pos_emb runs the native rotary kernel.

On the NPU: torch_npu's npu_rotary_mul within the limits its documentation states (ops/rotary_pos_emb.py's
npu_serves: batch and heads per rank, rotary dim; the three-argument schema of torch_npu without rotary_mode in
rotate-half), the op's reference elsewhere, so no configuration is refused for them."""

from mm_adaptor.core.features import Feature, FeatureConfigError, Flag, fused_kernel_tolerance, register, wrap_one
from mm_adaptor.core.verification import (BASE_RELEASE, ON_0_19_2, PIP_0_17_1, PIP_0_18_2,
                                     H100_SECOND_SESSION, TP2_DISTOPT, changed_since_h100, fake_npu_check,
                                     same_everywhere)


ROTARY_TYPES = ("rope", "mrope", "yarn")  # the position embeddings megatron applies with apply_rotary_pos_emb


@register
class FusedRotaryPosEmb(Feature):
    name = "fused-rotary-pos-emb"
    verified_on = {"0.16.1": BASE_RELEASE, "0.17.1": PIP_0_17_1, "0.18.0": PIP_0_18_2, "0.19.0": ON_0_19_2}
    devices = same_everywhere(changed_since_h100(
        "check --layout single of the previous kernel failed, fp32: alone, one step-1 gradient (layer 0's "
        "linear_qkv.bias) at 1.03x its limit; stacked with the other fused kernels, up to 5.7x (the harness's limits "
        "then rested on one noise draw at step 1 and did not re-round attention's backward; both changed in issue 53)",
        "issue 53: cos/sin once per position in shared memory", H100_SECOND_SESSION), fake_npu_check(
        TP2_DISTOPT, "npu_rotary_mul and npu_rotary_mul_backward (rotary_mode 'interleave' in tests/npu only)"))
    description = ("apply_rotary_pos_emb runs mm_adaptor::rotary_pos_emb for [s, b, h, d] (rotate-half and "
                   "interleaved, partial rotary); packed sequences, MLA, mscale != 1 and per-sample frequencies "
                   "(mRoPE with batch > 1) fall back to megatron with one warning")
    flags = (Flag("--use-fused-rotary-pos-emb", description),)
    tolerance = fused_kernel_tolerance("rotation in fp32 (megatron rounds cos/sin to the input dtype first)")

    def validate(self, options):
        if getattr(options, "position_embedding_type", None) not in ROTARY_TYPES:
            raise FeatureConfigError("--use-fused-rotary-pos-emb needs --position-embedding-type rope (or mrope, "
                                     "yarn): add it or drop --use-fused-rotary-pos-emb")

    def patch_sets(self, options):
        from mm_adaptor.patches.transformer.fused_ops import apply_rotary_pos_emb_fused

        return wrap_one(self.name, "megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb",
                        apply_rotary_pos_emb_fused)
