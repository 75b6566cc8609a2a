"""--use-flash-attn (Megatron-LM's own flag): the local spec's core attention runs PyTorch's fused attention."""

from mm_adaptor.features import Feature, FeatureConfigError, Flag, fused_kernel_tolerance, register, require_local_spec, wrap_one


@register
class FlashAttention(Feature):
    name = "flash-attn"
    description = ("the local spec's core attention (DotProductAttention) runs mm_adaptor.ops.flash_attention: "
                   "PyTorch's fused kernels, GQA, causal/padding masks, no s x s score matrix kept for backward")
    flags = (Flag("--use-flash-attn", description, megatron_owned=True),)
    tolerance = fused_kernel_tolerance("online softmax in fp32 blocks instead of one softmax over the score matrix")

    def validate(self, options):
        dropout = getattr(options, "attention_dropout", 0.0) or 0.0
        if dropout > 0:
            raise FeatureConfigError(f"--use-flash-attn does not support attention dropout (--attention-dropout "
                                     f"{dropout}): its mask could not be reproduced under megatron's RNG tracker; "
                                     "add --attention-dropout 0 or drop --use-flash-attn")
        require_local_spec(self, options)

    def patch_sets(self, options):
        from mm_adaptor.patches.transformer.fused_ops import dot_product_attention_forward_flash

        return wrap_one(self.name, "megatron.core.transformer.dot_product_attention.DotProductAttention.forward", dot_product_attention_forward_flash)
