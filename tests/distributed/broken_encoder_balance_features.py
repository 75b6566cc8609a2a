"""Deliberately wrong --encoder-dp-balance for tests/distributed/test_encoder_dp_balance.py (loaded into the training
ranks through MM_ADAPTOR_FEATURE_MODULES), each beside the real flag: the embeddings handed back to the wrong images
of their rank, the embeddings' gradients not sent back to the rank that encoded them, and the pixels sent in
bfloat16 (a subtle error: about 2^-9 of each pixel)."""

from mm_adaptor.core.features import Feature, Flag, fused_kernel_tolerance, register
from mm_adaptor.core.patching import PatchSet

TOLERANCE = fused_kernel_tolerance("claims the balance's rounding only")


def _no_gradient_home(ctx, grad):
    out = grad.new_zeros((sum(ctx.send), *grad.shape[1:]))
    import torch.distributed as dist

    dist.all_to_all_single(out, grad.contiguous() * 0, ctx.send, ctx.receive, group=ctx.group)
    return out, None, None, None


@register
class RowsToTheWrongImages(Feature):
    name = "test-broken-encoder-balance-order"
    description = "--encoder-dp-balance handing each rank's embeddings back in reverse image order"
    flags = (Flag("--use-test-broken-encoder-balance-order", description),)
    tolerance = TOLERANCE

    def patch_sets(self, options):
        ps = PatchSet(self.name)
        ps.replace("mm_adaptor.models.vision_language.VisionLanguageModel.encoder_balance_return_order",
                   staticmethod(lambda order: order[::-1]), create=True)
        return [ps]


@register
class GradientsNotSentHome(Feature):
    name = "test-broken-encoder-balance-gradients"
    description = "--encoder-dp-balance whose exchange sends zero gradients back to the encoding rank"
    flags = (Flag("--use-test-broken-encoder-balance-gradients", description),)
    tolerance = TOLERANCE

    def patch_sets(self, options):
        ps = PatchSet(self.name)
        ps.replace("mm_adaptor.models.encoder_balance._Exchange.backward", staticmethod(_no_gradient_home))
        return [ps]


def _pixels_through_bfloat16(wrapped, instance, args, kwargs):
    import torch

    encode = args[0]

    def lossy(given, grids):
        return encode(given.to(torch.bfloat16).float(), grids)

    return wrapped(lossy, *args[1:], **kwargs)


@register
class PixelsInBfloat16(Feature):
    name = "test-broken-encoder-balance-bf16-pixels"
    description = "--encoder-dp-balance sending the pixels in bfloat16 instead of exactly"
    flags = (Flag("--use-test-broken-encoder-balance-bf16-pixels", description),)
    tolerance = TOLERANCE

    def patch_sets(self, options):
        ps = PatchSet(self.name)
        ps.wrap("mm_adaptor.models.encoder_balance.balanced_rows", _pixels_through_bfloat16)
        return [ps]
