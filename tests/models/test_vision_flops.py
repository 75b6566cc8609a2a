"""The vision FLOPs the trainer adds to Megatron's count (mm_adaptor.models.vision_flops, for --log-throughput and
the MFU) equal what torch's FlopCounterMode counts in each family's tiny vision tower and projector, forward, on
images whose windows do not divide evenly. The varlen attention op is counted from the segments it is actually
called with (its cu_seqlens), so a window the formula gets wrong shows."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

from mm_adaptor.models import family_package, vision_flops



@pytest.fixture(scope="module", autouse=True)
def megatron_rank():
    from gloo_rank import one_gloo_rank
    from megatron.core import tensor_parallel

    with one_gloo_rank():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield


def _varlen_flops(q, k, v, cu_seqlens_q, *args, out_val=None, **kwargs):
    lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    return 4 * q.shape[1] * q.shape[2] * sum(n * n for n in lengths)  # scores and the weighted sum, each head


def _counted(model, pixels, grid) -> int:
    from torch.utils.flop_counter import flop_registry

    from mm_adaptor import ops  # noqa: F401  (registers the mm_adaptor ops)

    op = torch.ops.mm_adaptor.varlen_attention_fwd
    if op not in flop_registry and op.default not in flop_registry:
        register_flop_formula(op, get_raw=True)(_varlen_flops)
    model.requires_grad_(False)  # forward only (the counter's module tracker wants no no_grad region)
    with FlopCounterMode(display=False) as counter:
        model.visual_rows(pixels, grid)
    return counter.get_total_flops()


@pytest.mark.parametrize("family, grids", [
    ("qwen2_5_vl", [[1, 12, 20], [2, 8, 8]]),  # windows of 4 x 4 merged blocks: 12 x 20 patches cut 2 x 3 unevenly
    ("qwen3_vl", [[1, 8, 12], [2, 4, 4]]),
])
def test_qwen_vision_flops_are_what_the_tower_computes(family, grids):
    from mm_adaptor.models import registry

    spec, _ = registry.resolve(f"{family}-tiny")
    config = spec.tiny_config()
    model = spec.package_module().model_provider(config, pre_process=True, post_process=False).eval()
    grid = torch.tensor(grids)
    patches = int(grid.prod(dim=1).sum())
    pixels = torch.randn(patches, config.patch_dim)
    tower, projector = family_package(config).vision_forward_flops(config, {"image_grid_thw": grid})
    assert _counted(model, pixels, grid) == tower + projector


def test_internvl_vision_flops_are_what_the_tower_computes():
    from mm_adaptor.models import registry

    spec, _ = registry.resolve("internvl-tiny")
    config = spec.tiny_config()
    model = spec.package_module().model_provider(config, pre_process=True, post_process=False).eval()
    pixels = torch.randn(3, config.in_channels, config.image_size, config.image_size)
    tower, projector = family_package(config).vision_forward_flops(config, {"pixel_values": pixels})
    assert _counted(model, pixels, None) == tower + projector


def test_a_frozen_tower_is_counted_once_and_a_trained_one_three_times():
    assert vision_flops.training_flops(10.0, 1.0, tower_trained=False, projector_trained=True) == 13.0
    assert vision_flops.training_flops(10.0, 1.0, tower_trained=True, projector_trained=True) == 33.0


def test_windows_cut_from_the_top_left():
    # 12 x 20 patches, merge 2: 6 x 10 blocks, windows of 4 x 4 blocks: rows 4 + 2, columns 4 + 4 + 2
    expected = sum((r * c * 4) ** 2 for r in (4, 2) for c in (4, 4, 2))
    assert vision_flops.window_squares(1, 12, 20, 2, 4) == expected
