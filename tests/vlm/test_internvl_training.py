"""InternVL (--model internvl-tiny) trained by the driver on the generated shapes dataset (picture-dependent
captions; each image tiled as InternVL's processor does, models/internvl/tiles.py, <img> + 4 <IMG_CONTEXT> per
28 px tile + </img>), InternViT frozen: the loss falls by at least 20% in 20 iterations at TP2 with sequence
parallelism and at PP2 uneven (3 + 1 language layers). Measured 2026-11-26: 6.24 -> 2.34 (TP2), 6.28 -> 2.26
(PP2). Synthetic samples (no --data-path) run in test_internvl_features. Each rank's model and optimizer state
bytes equal models/internvl/memory.py's formula."""

import pytest

from mm_adaptor.harness.runner import parse_args, run
from hf_converted import convert_in_process

pytestmark = pytest.mark.distributed

LAYOUTS = {  # name: (flags, TP, language split)
    "tp2_sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, [4]),
    "pp2_uneven": (["--pipeline-model-parallel-size", "2", "--pipeline-layers", "3,1"], 1, [3, 1]),
}
KINDS = ("parameter_bytes", "gradient_bytes", "optimizer_main_param_bytes", "optimizer_moment_bytes")


def _changed(rank, prefix) -> bool:
    return any(not before.equal(rank.params[k]) for k, before in rank.initial_params.items() if prefix in k)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_falls_with_internvit_frozen(shapes, layout):
    """Also: each rank's measured model and optimizer state (devices.memory.model_state_bytes, in the dump) equals
    the formula of models/internvl/memory.py (which docs/memory.md's InternVL tables come from) to the byte."""
    from mm_adaptor.models.internvl import tiny_config
    from mm_adaptor.models.internvl.memory import rank_state

    flags, tp, split = LAYOUTS[layout]
    dump = run(parse_args(["--model", "internvl-tiny", "--data-path", shapes, "--seq-length", "256", "--lr", "1e-2",
                           "--train-iters", "20", "--timeout", "300", "--freeze-vision", *flags]))
    for index, rank in enumerate(dump.ranks):
        expected = rank_state(tiny_config(), tp, split, dp=1, distributed_optimizer=False, params_dtype="float32",
                              frozen_vision=True, stage=index if len(split) > 1 else 0)
        assert {kind: rank.memory[kind] for kind in KINDS} == {kind: getattr(expected, kind) for kind in KINDS}
        assert rank.memory["device_bytes"] == expected.device_bytes
    assert len(dump.losses) == 20
    assert dump.losses[19] <= 0.8 * dump.losses[0], dump.losses
    first = dump.ranks[0]
    assert any("vision_model." in k for k in first.initial_params)
    assert not _changed(first, "vision_model."), "the frozen vision tower changed"
    assert _changed(first, "vision_projection.") and _changed(first, "language_model.")
    if layout == "pp2_uneven":  # InternViT and the projector live on the first stage only
        assert not any("vision" in k for k in dump.ranks[1].params)


def test_converted_checkpoint_trains_the_projector_only(shapes, tmp_path):
    """--model internvl --load (make_tiny_hf, converted) --data-path at TP2 with both towers frozen (and --log-tps):
    only the projector changes, and it is all that is trainable (its elements per rank from the formula)."""
    from mm_adaptor.models.internvl import config_from_hf
    from mm_adaptor.models.internvl.memory import projector_elements
    from mm_adaptor.models.make_tiny_hf import make_tiny_hf

    hf = make_tiny_hf(str(tmp_path / "hf"), "internvl", seed=5)
    convert_in_process(tmp_path / "hf", tmp_path / "mcore")
    dump = run(parse_args(["--model", "internvl", "--load", str(tmp_path / "mcore"), "--data-path", shapes,
                           "--seq-length", "256", "--train-iters", "3", "--timeout", "300", "--freeze-vision",
                           "--freeze-language", "--log-tps", "--tensor-model-parallel-size", "2"]))
    for rank in dump.ranks:
        changed = {k.split(".")[2] for k, before in rank.initial_params.items() if not before.equal(rank.params[k])}
        assert changed == {"vision_projection"}
        assert rank.memory["trainable_elements"] == projector_elements(config_from_hf(hf.config.to_dict()), tp=2)
