"""--use-fused-rotary-pos-emb: megatron's apply_rotary_pos_emb runs the native rotary kernel."""

from mm_adaptor.features import Feature, FeatureConfigError, Flag, fused_kernel_tolerance, register, wrap_one


@register
class FusedRotaryPosEmb(Feature):
    name = "fused-rotary-pos-emb"
    description = ("apply_rotary_pos_emb runs mm_adaptor::rotary_pos_emb for [s, b, h, d] (rotate-half and "
                   "interleaved); packed sequences, MLA, mscale and mRoPE fall back to megatron with one warning")
    flags = (Flag("--use-fused-rotary-pos-emb", description),)
    tolerance = fused_kernel_tolerance("rotation in fp32 (megatron rounds cos/sin to the input dtype first)")

    def validate(self, options):
        if getattr(options, "position_embedding_type", None) != "rope":
            raise FeatureConfigError("--use-fused-rotary-pos-emb needs --position-embedding-type rope: add it or drop "
                                     "--use-fused-rotary-pos-emb")

    def patch_sets(self, options):
        from mm_adaptor.patches.transformer.fused_ops import apply_rotary_pos_emb_fused

        return wrap_one(self.name, "megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb", apply_rotary_pos_emb_fused)
