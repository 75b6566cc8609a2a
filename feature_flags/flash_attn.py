"""--use-flash-attn (Megatron-LM's own flag): the local spec's core attention runs PyTorch's fused attention."""

from functools import partial

from mm_adaptor.core.features import Feature, Flag, fused_kernel_tolerance, register, wrap_one
from mm_adaptor.core.verification import STACKED_FUSED_FAILED_ON_H100, TP2_DISTOPT, fake_npu_check, same_everywhere


@register
class FlashAttention(Feature):
    name = "flash-attn"
    devices = same_everywhere(STACKED_FUSED_FAILED_ON_H100, fake_npu_check(
        TP2_DISTOPT, "npu_fusion_attention and npu_fusion_attention_grad"))
    description = ("the local spec's core attention (DotProductAttention) runs mm_adaptor.ops.flash_attention: "
                   "PyTorch's fused kernels, GQA, causal/padding/sliding-window masks, attention dropout (PyTorch's "
                   "fused kernels' on CUDA, torch_npu.npu_fusion_attention's on the NPU, a blockwise fp32 kernel on "
                   "the CPU, under megatron's RNG tracker), no s x s matrix kept for backward; Megatron-LM's "
                   "per-document masks (--reset-attention-mask) without dropout run as the documents of "
                   "mm_adaptor.ops.varlen_attention (no s x s scores); attention bias and softmax offsets run "
                   "megatron's attention, packed sequences --packing's varlen attention. With Transformer Engine "
                   "(--transformer-impl transformer_engine) the flag keeps Megatron's meaning")
    flags = (Flag("--use-flash-attn", description, megatron_owned=True),)
    tolerance = fused_kernel_tolerance("online softmax in fp32 blocks instead of one softmax over the score matrix; "
                                       "attention dropout masks are drawn differently (same distribution), so "
                                       "compare with --attention-dropout 0")

    def stands_aside(self, options):
        impl = getattr(options, "transformer_impl", "local")
        if impl != "local":
            return (f"--transformer-impl {impl} builds Transformer Engine's attention, which serves --use-flash-attn "
                    "itself; mm_adaptor's flash attention patches the local spec only")
        return None

    def patch_sets(self, options):
        from mm_adaptor.patches.transformer.document_masks import DOCUMENTS
        from mm_adaptor.patches.transformer.fused_ops import CausalMaskRule, dot_product_attention_forward_flash

        # Megatron-LM's data loader builds the default causal mask unless --reset-attention-mask (CausalMaskRule),
        # and per-document masks with it (served as the varlen op's segments)
        reset = getattr(options, "reset_attention_mask", None)
        masks = CausalMaskRule(data_masks_are_causal=reset is False)
        return wrap_one(self.name, "megatron.core.transformer.dot_product_attention.DotProductAttention.forward",
                        partial(dot_product_attention_forward_flash, causal_masks=masks,
                                documents=DOCUMENTS if reset else None))
