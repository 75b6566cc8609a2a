"""Checkpoints of a feature, both ways: saved at step 2 with and without it, each loaded with and without it,
training steps 3-4 exactly as the uninterrupted run without it (loading and saving without it on both sides is
the driver's own resume test)."""

from mm_adaptor.harness import runner as train
from mm_adaptor.harness import LAYOUTS
from mm_adaptor.harness.runner.checkpoint import MARKER


def losses(layout, extra, iters):
    args = train.parse_args([*LAYOUTS[layout], *extra, "--train-iters", str(iters), "--nproc-per-node", "2",
                             "--timeout", "300", "--silent"])
    return train.run(args).losses


def assert_checkpoints_load_both_ways(tmp_path, layout, flags, extra=()):
    without = tmp_path / "saved-without"
    # the uninterrupted run saves at 2 (and 4); its marker is set back to 2: that is the checkpoint saved without
    straight = losses(layout, [*extra, "--save", str(without), "--save-interval", "2"], 4)
    (without / MARKER).write_text("2")
    with_feature = tmp_path / "saved-with"
    assert losses(layout, [*extra, *flags, "--save", str(with_feature)], 2) == straight[:2]
    for saved, loaded_with in ((with_feature, flags), (with_feature, []), (without, flags)):
        resumed = losses(layout, [*extra, *loaded_with, "--load", str(saved)], 4)
        assert resumed == straight[2:], (saved.name, loaded_with, resumed, straight)
