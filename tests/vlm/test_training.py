"""Qwen2.5-VL (--model qwen2_5_vl-tiny) trained by the driver on the generated shapes dataset: the loss falls at TP2
and at PP2 (1 + 3 layers) with the vision encoder frozen, frozen parameters stay bit-identical and hold no gradient
buffer or optimizer state, projector-only alignment changes the projector only, and a run resumed at iteration
10 gives the uninterrupted run's losses digit for digit."""

import pytest

from mm_adaptor.harness.runner import parse_args, run

pytestmark = pytest.mark.distributed

FP32_BYTES, ADAM_MOMENTS = 4, 2


def _args(shapes, *extra):
    return parse_args(["--model", "qwen2_5_vl-tiny", "--data-path", shapes, "--seq-length", "256", "--lr", "1e-2",
                       "--train-iters", "20", "--timeout", "300", *extra])


def _tower(key: str) -> str:
    for tower in ("vision_model", "vision_projection", "language_model"):
        if f".{tower}." in f".{key}":
            return tower
    raise AssertionError(key)


def _changed_towers(rank) -> set:
    return {_tower(k) for k, before in rank.initial_params.items() if not before.equal(rank.params[k])}


def _assert_frozen_state(rank):
    """Frozen elements exist and have neither a gradient buffer nor Adam moments (fp32, no distributed optimizer:
    each trainable element has 4 gradient bytes and 2 x 4 moment bytes, nothing more)."""
    memory = rank.memory
    assert memory["frozen_elements"] > 0, memory
    assert memory["gradient_bytes"] == FP32_BYTES * memory["trainable_elements"], memory
    assert memory["optimizer_moment_bytes"] == ADAM_MOMENTS * FP32_BYTES * memory["trainable_elements"], memory


@pytest.fixture(scope="module")
def tp2(shapes):
    return run(_args(shapes, "--tensor-model-parallel-size", "2", "--freeze-vision"))


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_loss_falls_with_the_vision_encoder_frozen(request, shapes, layout):
    if layout == "tp2":
        dump = request.getfixturevalue("tp2")
    else:
        dump = run(_args(shapes, "--pipeline-model-parallel-size", "2", "--pipeline-layers", "1,3", "--freeze-vision"))
    assert len(dump.losses) == 20
    assert dump.losses[19] <= 0.8 * dump.losses[0], dump.losses
    first = dump.ranks[0]  # holds the vision encoder in both layouts
    assert any(_tower(k) == "vision_model" for k in first.params)
    assert _changed_towers(first) == {"vision_projection", "language_model"}
    _assert_frozen_state(first)
    if layout == "pp2":
        assert {_tower(k) for k in dump.ranks[1].params} == {"language_model"}


def test_projector_only_alignment_changes_the_projector_only(shapes):
    dump = run(_args(shapes, "--tensor-model-parallel-size", "2", "--freeze-vision", "--freeze-language",
                     "--train-iters", "3"))
    for rank in dump.ranks:
        assert _changed_towers(rank) == {"vision_projection"}
        _assert_frozen_state(rank)
        projector = sum(p.numel() for k, p in rank.params.items() if _tower(k) == "vision_projection")
        assert rank.memory["trainable_elements"] == projector


def test_resume_at_iteration_10_prints_the_uninterrupted_losses(tp2, shapes, tmp_path):
    tp2_args = ("--tensor-model-parallel-size", "2", "--freeze-vision")
    first = run(_args(shapes, *tp2_args, "--train-iters", "10", "--save", str(tmp_path)))
    resumed = run(_args(shapes, *tp2_args, "--load", str(tmp_path)))
    lines = [f"{loss:.6E}" for loss in first.losses + resumed.losses]
    assert len(resumed.losses) == 10
    assert lines == [f"{loss:.6E}" for loss in tp2.losses]
    assert first.losses + resumed.losses == tp2.losses
