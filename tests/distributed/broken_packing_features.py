"""Deliberately wrong --packing, registered only for tests/distributed/test_packing.py (loaded into the training
ranks through MM_ADAPTOR_FEATURE_MODULES); each must fail the packed-against-padded comparison."""

from mm_adaptor.core.features import Feature, Flag, fused_kernel_tolerance, register
from mm_adaptor.core.patching import PatchSet

TOLERANCE = fused_kernel_tolerance("claims packing's rounding only")


def _one_segment(wrapped, instance, args, kwargs):
    """Attention across the samples of a pack: the whole pack as one causal segment."""
    cu_q, cu_kv, _, _ = wrapped(*args, **kwargs)
    whole = cu_q[[0, -1]].contiguous()
    total = int(cu_q[-1])
    return whole, whole.clone(), total, total


def _continuous_params(wrapped, instance, args, kwargs):
    """max_seqlen of the pack's length: megatron's THD rope then continues positions across samples."""
    params = wrapped(*args, **kwargs)
    params.max_seqlen_q = params.max_seqlen_kv = int(params.cu_seqlens_q[-1])
    return params


def _continuous_positions(wrapped, instance, args, kwargs):
    """Learned position embeddings counted over the pack, not per sample."""
    import torch

    batch = wrapped(*args, **kwargs)
    positions = batch["position_ids"]
    batch["position_ids"] = torch.arange(positions.shape[-1]).expand_as(positions).contiguous()
    return batch


def _first_document_one_token_late(wrapped, instance, args, kwargs):
    """The first boundary of each per-document mask row read one token late: the second document's first token
    attends to the whole first document."""
    rows = wrapped(*args, **kwargs)

    def late(lengths):
        if len(lengths) < 2:
            return lengths
        first, second, *rest = lengths
        return [first + 1, second - 1, *rest] if second > 1 else [first + second, *rest]

    return None if rows is None else [late(lengths) for lengths in rows]


class BrokenPacking(Feature):
    tolerance = TOLERANCE
    wraps: tuple = ()  # (target, wrapper)

    def patch_sets(self, options):
        ps = PatchSet(self.name)
        for target, wrapper in self.wraps:
            ps.wrap(target, wrapper)
        return [ps]


@register
class PackingAcrossSamples(BrokenPacking):
    name = "test-packing-across-samples"
    description = "packed attention that lets every token attend to earlier samples of its pack"
    flags = (Flag("--use-test-packing-across-samples", description),)
    wraps = (("mm_adaptor.patches.transformer.packed_attention.segment_bounds", _one_segment),)


@register
class PackingPositionsContinue(BrokenPacking):
    name = "test-packing-positions-continue"
    description = "packing whose positions run on across the samples of a pack instead of restarting"
    flags = (Flag("--use-test-packing-positions-continue", description),)
    wraps = (("mm_adaptor.data.packing.packed_seq_params", _continuous_params),
             ("mm_adaptor.data.packing.pack", _continuous_positions))


@register
class DocumentsOneTokenLate(BrokenPacking):
    name = "test-documents-one-token-late"
    description = "per-document masks read with each row's first document boundary one token late"
    flags = (Flag("--use-test-documents-one-token-late", description),)
    wraps = (("mm_adaptor.patches.transformer.document_masks.document_lengths", _first_document_one_token_late),)
