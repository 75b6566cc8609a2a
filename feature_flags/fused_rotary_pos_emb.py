"""--use-fused-rotary-pos-emb: megatron's apply_rotary_pos_emb runs the native rotary kernel."""

from mm_adaptor.features import Feature, FeatureConfigError, Flag, Tolerance, register
from mm_adaptor.patching import Contract, PatchSet


@register
class FusedRotaryPosEmb(Feature):
    name = "fused-rotary-pos-emb"
    description = ("apply_rotary_pos_emb runs mm_adaptor::rotary_pos_emb for [s, b, h, d] (rotate-half and "
                   "interleaved); packed sequences, MLA, mscale and mRoPE fall back to megatron with one warning")
    flags = (Flag("--use-fused-rotary-pos-emb", description),)
    tolerance = Tolerance(exact=False, rtol=1e-3, atol=5e-4, low_precision_rtol=5e-2, low_precision_atol=1e-2,
                          why="rotation in fp32 (megatron rounds cos/sin to the input dtype first): fp32-rounding-level differences, which Adam can turn into parameter differences "
                          "up to lr per step on near-zero gradients; bf16: one bf16 ulp")

    def validate(self, options):
        if getattr(options, "position_embedding_type", None) != "rope":
            raise FeatureConfigError("--use-fused-rotary-pos-emb needs --position-embedding-type rope: add it or drop "
                                     "--use-fused-rotary-pos-emb")

    def patch_sets(self, options):
        from mm_adaptor.patches.transformer.fused_ops import apply_rotary_pos_emb_fused

        ps = PatchSet(self.name)
        ps.wrap("megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb", apply_rotary_pos_emb_fused,
                contract=Contract(versions=">=0.16.0,<0.17"))
        return [ps]
