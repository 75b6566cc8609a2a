"""--encoder-dp-balance (mm_adaptor/models/encoder_balance.py) on the tiny Qwen2.5-VL at DP2, a generated shapes data
set (images of 112 to 308 px sides, 4 per micro-batch and rank; one step holds all 16): the balanced run against the
unbalanced one, the same losses, module outputs, gradients and parameters within the calibrated rounding noise
(measured: losses and module outputs equal, the vision tower's gradients 0.48 x the limit: the encoder's weight
gradients summed over other images per rank); the patches per rank more even and images moved (the mechanism
ran); the same at TP2+SP and PP2 beside DP2 on four ranks. At CP2 (and CP2 x DP2) the context-parallel ranks share
their common images instead of each encoding all of them: patches per rank halve (3388 -> 1720/1668), gradients
0.25 x the limit. Broken variants must fail at DP2 and CP2: embeddings handed back to the wrong images, gradients
not sent home, pixels sent in bfloat16. The assignment and the refusals are tested without ranks."""

import functools

import pytest

from mm_adaptor import harness
from mm_adaptor.harness import runner as train
from mm_adaptor.core.features import Tolerance
from mm_adaptor.harness import baseline, verdict
from mm_adaptor.harness.compare import NOISE_PARTS, checked_args, rounding_noise_run
from mm_adaptor.models.encoder_balance import assign

TOLERANCE = Tolerance(exact=False, factor=1.0, why="each image encoded alone; weight gradients summed over other "
                                                   "images per rank, then over the ranks")


# beside DP2: the tensor-parallel ranks of a DP rank hold the same images and must move the same ones; at PP2 only
# the first stage has a vision tower
LAYOUTS = {"dp2": ["--nproc-per-node", "2"],
           "tp2-dp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--nproc-per-node", "4"],
           "pp2-dp2": ["--pipeline-model-parallel-size", "2", "--nproc-per-node", "4"],
           # context-parallel ranks hold the same images: unbalanced each encodes all of them, balanced they share
           "cp2": ["--context-parallel-size", "2", "--nproc-per-node", "2"],
           "cp2-dp2": ["--context-parallel-size", "2", "--context-parallel-algo", "ulysses_cp_algo",
                       "--nproc-per-node", "4"]}


@functools.lru_cache(maxsize=None)
def unbalanced(data_dir, layout="dp2"):
    from mm_adaptor.data.shapes import make_shapes

    shapes = make_shapes(data_dir, count=16, seed=3)
    model = ["--model", "qwen2_5_vl-tiny", "--data-path", shapes, "--num-layers", "2", "--seq-length", "512",
             "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", "1", *LAYOUTS[layout]]
    off_args = checked_args(model)
    off = baseline.cached_run(off_args)
    noise = [rounding_noise_run(off_args, parts=parts) for parts in NOISE_PARTS]
    return model, off, verdict.limits_for(TOLERANCE, "fp32", verdict.noise_table(off, *noise))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_balanced_equals_unbalanced_and_evens_the_encoders_work(tmp_path_factory, layout):
    model, off, limits = unbalanced(str(tmp_path_factory.getbasetemp() / "shapes"), layout)
    on = train.run(checked_args([*model, "--encoder-dp-balance"]))
    verdicts = verdict.judge(off, on, limits)
    failures = {group: v.failures[:3] for group, v in verdicts.items() if v.failures}
    assert not failures, failures
    assert all(verdicts[group].count for group in ("loss", "gradients", "parameters"))
    stats = on.memory["encoder_balance"]
    before, after = stats["patches_before"], stats["patches_after"]
    cp = 2 if layout.startswith("cp2") else 1
    assert stats["calls"] > 0 and sum(before) == cp * sum(after) and max(after) < max(before), stats
    if layout != "cp2":  # images left their data-parallel rank, and the work per rank is more even
        assert stats["images_moved"] > 0 and max(after) - min(after) < max(before) - min(before), stats


@pytest.mark.distributed
@pytest.mark.parametrize("broken, layout", [("--use-test-broken-encoder-balance-order", "cp2"),
                                            ("--use-test-broken-encoder-balance-gradients", "dp2"),
                                            ("--use-test-broken-encoder-balance-bf16-pixels", "dp2")])
def test_broken_balance_fails(tmp_path_factory, broken, layout):
    model, off, limits = unbalanced(str(tmp_path_factory.getbasetemp() / "shapes"), layout)
    with harness.extra_feature_module("broken_encoder_balance_features"):
        on = train.run(checked_args([*model, "--encoder-dp-balance", broken]))
    assert broken.removeprefix("--use-") in on.features
    assert verdict.judge(off, on, limits)["gradients"].failures


def test_assignment_evens_patches_and_keeps_even_loads_home():
    assert assign([[(1, 4, 4)] * 3, [(1, 4, 4)] * 3]) == [[0, 0, 0], [1, 1, 1]]
    grids = [[(1, 8, 8), (1, 8, 8), (1, 4, 4)], [(1, 2, 2)]]
    owner = assign(grids)
    load = [0, 0]
    for rank, images in enumerate(grids):
        for (t, h, w), o in zip(images, owner[rank]):
            load[o] += t * h * w
    assert owner == [[0, 1, 0], [1]] and load == [80, 68]  # longest first, each to the least loaded


@pytest.mark.parametrize("argv, expected", [
    (["--model", "qwen3_vl-tiny"], "--encoder-dp-balance is built for Qwen2.5-VL so far"),
    (["--model", "qwen2_5_vl-tiny", "--packing", "--micro-batch-size", "1"],
     "--packing gives ranks different numbers of micro-batches"),
    ([], "it needs a vision-language --model"),
], ids=["qwen3-vl", "packing", "gpt"])
def test_refusals_are_one_line_and_exit_2_before_any_rank(argv, expected):
    pytest.importorskip("megatron.training")
    from trainer_runs import train as trainer

    run = trainer([*argv, "--encoder-dp-balance", "--nproc-per-node", "2", "--train-iters", "1",
                   "--calculate-per-token-loss", "--attention-dropout", "0"])
    assert run.status == 2, run.err
    err = run.err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_assignment_shares_a_homes_images_among_its_ranks():
    """Two context-parallel ranks (0, 1) hold home 0's images, rank 2 alone home 1's: the large images split over
    home 0's ranks, home 1's image stays home, the small ones go to the least loaded rank (loads 64, 64, 48)."""
    grids = [[(1, 8, 8), (1, 8, 8), (1, 4, 4), (1, 4, 4)], [(1, 4, 4)]]
    owner = assign(grids, holders=[[0, 1], [2]])
    assert owner == [[0, 1, 2, 2], [2]]
