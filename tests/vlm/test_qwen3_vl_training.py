"""Qwen3-VL (--model qwen3_vl-tiny, qwen3_vl_moe-tiny) trained by the driver on the generated shapes dataset, the
vision tower frozen: the loss falls by at least 20% in 20 iterations at TP2, at PP2 with the DeepStack layers on
the first stage, and for the MoE model at EP2 (its experts split over the two ranks); a split that would put
DeepStack layers on a later stage is refused in one line before any rank starts."""

import pytest

from mm_adaptor.harness.runner import LayoutError, check_args, parse_args, run

pytestmark = pytest.mark.distributed


def _args(shapes, model, *extra):
    return parse_args(["--model", model, "--data-path", shapes, "--seq-length", "256", "--lr", "1e-2",
                       "--train-iters", "20", "--timeout", "300", "--freeze-vision", *extra])


def _changed(rank, prefix) -> bool:
    return any(not before.equal(rank.params[k]) for k, before in rank.initial_params.items() if prefix in k)


LAYOUTS = {
    "tp2": ("qwen3_vl-tiny", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2_deepstack": ("qwen3_vl-tiny", ["--pipeline-model-parallel-size", "2", "--pipeline-layers", "3,1"]),
    "moe_ep2": ("qwen3_vl_moe-tiny", ["--expert-model-parallel-size", "2"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_falls_with_the_vision_tower_frozen(shapes, layout):
    model, flags = LAYOUTS[layout]
    dump = run(_args(shapes, model, *flags))
    assert len(dump.losses) == 20
    assert dump.losses[19] <= 0.8 * dump.losses[0], dump.losses
    first = dump.ranks[0]
    assert not _changed(first, "vision_model.decoder."), "the frozen vision tower changed"
    assert _changed(first, "language_model.")
    if layout == "pp2_deepstack":  # the DeepStack mergers and the vision tower live on the first stage only
        assert any("deepstack" in k for k in first.params)
        assert not any(k.split(".")[0].startswith("vision") for k in dump.ranks[1].params)
    if layout == "moe_ep2":  # each rank trains its own half of the experts
        experts = [sorted(k for k in rank.params if ".experts." in k) for rank in dump.ranks]
        assert experts[0] and experts[0] == experts[1]  # local names, one half each
        assert all(_changed(rank, ".experts.") for rank in dump.ranks)
        assert not dump.ranks[0].params[experts[0][0]].equal(dump.ranks[1].params[experts[0][0]])


def test_a_split_that_puts_deepstack_layers_on_a_later_stage_is_refused(shapes):
    args = parse_args(["--model", "qwen3_vl-tiny", "--pipeline-model-parallel-size", "2", "--pipeline-layers", "1,3",
                       "--nproc-per-node", "2"])
    with pytest.raises(LayoutError) as error:
        check_args(args, 2, check_devices=False)
    assert len(error.value.problems) == 1 and "DeepStack" in error.value.problems[0], error.value.problems
