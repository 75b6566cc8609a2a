"""--packing against unpatched Megatron: the same skewed-length samples, packed (PackedSeqParams through the varlen
op) and one per micro-batch padded to --seq-length (megatron's own attention, loss masked on the padding), give the
same loss per step, gradients per step and parameters within the calibrated tolerance of a fused kernel. Module
outputs are not compared: the first micro-batch holds one sample padded against a whole pack.

Two broken variants (broken_packing_features.py) must fail: attention across the samples of a pack, positions
running on across them. Packs split over two context-parallel ranks (ring and Ulysses, GPT and VLM) are judged
against the padded data-parallel run too, with attention across samples as their broken variant."""

import json
import functools
from pathlib import Path

import pytest

from mm_adaptor import harness
from mm_adaptor.harness import runner as train
from mm_adaptor.core.features import Tolerance
from mm_adaptor.harness import baseline, verdict
from mm_adaptor.harness.compare import NOISE_PARTS, checked_args, rounding_noise_run

pytestmark = pytest.mark.distributed

# factor 2: the calibration perturbs the sums inside each matrix product; packing also regroups the step's sums
# across micro-batches (a pack's embedding-gradient scatter adds several samples' rows before main_grad does), a
# reordering the perturbation does not make (measured: 1.33 x the x1 limit, a word-embedding gradient's scale)
TOLERANCE = Tolerance(exact=False, factor=2.0, why="varlen attention on packs instead of megatron's softmax on padded "
                                                   "rows; the step's tokens summed in other micro-batches")
# a data set's images are larger (up to hundreds of patches each): the vision tower's weight gradients then sum
# a whole pack's patch rows in one matrix product instead of one sample's (measured: the patch embedding's gradient
# at 1.95 x the x2 limit, its scale 5.9e-8), a regrouping the perturbation does not make; attention across samples
# fails at 7.7e5 x the x4 limit (asserted below)
DATA_SET_TOLERANCE = Tolerance(exact=False, factor=4.0, why=TOLERANCE.why + "; a pack's patches in one product")
JUDGED = ("loss", "gradients", "parameters")
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--mock-lengths", "skewed", "--train-iters", "2"]
LAYOUTS = {
    "dp2-rope": ["--position-embedding-type", "rope", "--nproc-per-node", "2"],  # also what packed CP2 is judged by
    "tp2-sp-rope": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--position-embedding-type", "rope",
                    "--nproc-per-node", "2"],
    "pp2-learned": ["--pipeline-model-parallel-size", "2", "--nproc-per-node", "2"],
    # the tiny Qwen2.5-VL's synthetic image samples, skewed: 3-D rope positions per sample, the images of a pack's
    # samples through the vision tower together, their rows at their own pad tokens
    "vlm-dp2": ["--model", "qwen2_5_vl-tiny", "--nproc-per-node", "2"],
    "qwen3-vl-dp2": ["--model", "qwen3_vl-tiny", "--nproc-per-node", "2"],  # DeepStack features per segment too
    "internvl-dp2": ["--model", "internvl-tiny", "--nproc-per-node", "2"],  # 1-D rope, tiles
    "vlm-tp2-sp": ["--model", "qwen2_5_vl-tiny", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                   "--nproc-per-node", "2"],
    "vlm-pp2": ["--model", "qwen2_5_vl-tiny", "--pipeline-model-parallel-size", "2", "--nproc-per-node", "2"],
}
# the padded runs packed context parallelism beside TP+SP or PP is judged by (four ranks: CP2 against DP2)
CONTEXT_PARALLEL_REFERENCES = {
    "tp2-sp-dp2-rope": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--position-embedding-type",
                        "rope", "--nproc-per-node", "4"],
    "pp2-dp2-learned": ["--pipeline-model-parallel-size", "2", "--nproc-per-node", "4"],
    "dp2-rope-bf16": ["--position-embedding-type", "rope", "--bf16", "--nproc-per-node", "2"],
}


class PackedAgainstPadded:
    """The padded run and its rounding noise (cached per configuration), judged against packed runs."""

    def __init__(self, layout_args, model=MODEL, tolerance=TOLERANCE):
        self.off_args = checked_args([*model, *layout_args])
        self.on_base = [*model, *layout_args, "--packing"]
        self.off = baseline.cached_run(self.off_args)
        noise = [rounding_noise_run(self.off_args, parts=parts) for parts in NOISE_PARTS]
        precision = "bf16" if "--bf16" in layout_args else "fp32"
        self.limits = verdict.limits_for(tolerance, precision, verdict.noise_table(self.off, *noise))

    @functools.cached_property
    def packed(self):
        """The packed run without other flags (trained once)."""
        return train.run(checked_args(self.on_base))

    def judge(self, *extra):
        on = train.run(checked_args([*self.on_base, *extra])) if extra else self.packed
        verdicts = verdict.judge(self.off, on, self.limits)
        return on, {group: verdicts[group] for group in JUDGED}


@functools.lru_cache(maxsize=None)
def reference(layout: str) -> PackedAgainstPadded:
    return PackedAgainstPadded({**LAYOUTS, **CONTEXT_PARALLEL_REFERENCES}[layout])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_packed_equals_padded(layout):
    on, verdicts = reference(layout).judge()
    failures = {group: v.failures[:3] for group, v in verdicts.items() if v.failures}
    assert not failures, f"{layout}: {failures}"
    assert all(v.count for v in verdicts.values())
    ran = on.memory["packed_attention"]
    # the varlen op ran on this rank; the last pack's bounds hold several samples and end at --seq-length
    assert ran["calls"] > 0 and len(ran["last_cu_seqlens"]) > 2, ran
    if layout.startswith("vlm"):  # the vision tower's gradients, from the images of each pack, were judged too
        steps = on.ranks[0].grads
        assert any(name.startswith("vision_model") or ".vision_model." in name for name in steps[0]), steps[0]
    assert ran["last_cu_seqlens"][-1] == 64
    assert len(on.losses) == 2


def test_packing_beside_flash_attention():
    """--use-flash-attn hands packed calls on to --packing's varlen attention (one warning says so): the run still
    equals the padded one, and the varlen op served the packs."""
    on, verdicts = reference("tp2-sp-rope").judge("--use-flash-attn")
    failures = {group: v.failures[:3] for group, v in verdicts.items() if v.failures}
    assert not failures, failures
    assert "flash-attn" in on.features and on.memory["packed_attention"]["calls"] > 0


@pytest.mark.parametrize("broken, layout", [("--use-test-packing-across-samples", "tp2-sp-rope"),
                                            ("--use-test-packing-across-samples", "vlm-pp2"),
                                            ("--use-test-packing-positions-continue", "pp2-learned")])
def test_broken_packing_fails(broken, layout):
    """Positions that run on are judged with learned position embeddings: rope within a segment sees relative
    positions only, unchanged by an offset (megatron's THD rope restarts them anyway, see data/packing.py). So is the
    VLMs' 3-D rope: positions run on over a pack differ from restarted ones by one offset per sample in all three
    sections, which rope cancels within a sample; attention across samples is what a VLM pack can get wrong."""
    with harness.extra_feature_module("broken_packing_features"):
        on, verdicts = reference(layout).judge(broken)
    assert on.features and broken.removeprefix("--use-") in on.features
    assert verdicts["gradients"].failures, f"{broken} passed: {verdicts['gradients'].worst}"


# attention across samples everywhere the ring runs; on the GPT also subtler ones (measured, gradients: the 0.1%
# softmax scale at 7.1 x the limit, a token seeing the next one of its sample at 2.8e6 x, Ulysses' heads in the wrong
# order); in bf16 (the correct run at 0.22 x) across samples at 79 x, one token ahead at 51 x
BROKEN_PACKED_CONTEXT_PARALLEL = {
    ("dp2-rope", "megatron_cp_algo"): ("--use-test-broken-cp-packed-across", "--use-test-broken-cp-ring-scale",
                                       "--use-test-broken-cp-packed-ahead"),
    ("dp2-rope", "ulysses_cp_algo"): ("--use-test-broken-cp-ulysses-heads",),
    ("vlm-dp2", "megatron_cp_algo"): ("--use-test-broken-cp-packed-across",),
    ("qwen3-vl-dp2", "megatron_cp_algo"): ("--use-test-broken-cp-packed-across",),
    ("internvl-dp2", "megatron_cp_algo"): ("--use-test-broken-cp-packed-across",),
    ("tp2-sp-dp2-rope", "megatron_cp_algo"): ("--use-test-broken-cp-packed-across",),
    ("dp2-rope-bf16", "megatron_cp_algo"): ("--use-test-broken-cp-packed-across", "--use-test-broken-cp-packed-ahead"),
}


# the VLMs' CP code is the same for every algorithm (the algorithm acts in attention alone): Ulysses runs on the GPT
@pytest.mark.parametrize("layout, algo", [("dp2-rope", "megatron_cp_algo"), ("dp2-rope", "ulysses_cp_algo"),
                                          ("vlm-dp2", "megatron_cp_algo"),
                                          ("qwen3-vl-dp2", "megatron_cp_algo"), ("internvl-dp2", "megatron_cp_algo"),
                                          ("tp2-sp-dp2-rope", "megatron_cp_algo"),
                                          ("pp2-dp2-learned", "ulysses_cp_algo"),
                                          ("dp2-rope-bf16", "megatron_cp_algo")])
def test_packed_context_parallel_equals_padded_data_parallel(layout, algo):
    """--packing at --context-parallel-size 2 (every segment of a pack split over the two ranks, attention masked
    by segment and position; for the VLM the vision rows placed on the whole pack, then cut per segment, and the
    3-D rope's frequencies of the whole pack) against unpatched Megatron's padded micro-batches on two data-parallel
    ranks: the same step's samples, loss per token, gradients and parameters (measured: 0.14 to 0.52 x the limit,
    at weight gradients' scales); attention across the samples fails (the VLM's at 1.4e6 x)."""
    cp = ["--context-parallel-size", "2", "--context-parallel-algo", algo]
    on, verdicts = reference(layout).judge(*cp)
    failures = {group: v.failures[:3] for group, v in verdicts.items() if v.failures}
    assert not failures, f"{algo}: {failures}"
    assert all(v.count for v in verdicts.values())
    assert on.memory["feature_statistics"]["context-parallel"][f"{algo} packed attention calls"] > 0
    for flag in BROKEN_PACKED_CONTEXT_PARALLEL.get((layout, algo), ()):
        with harness.extra_feature_module("broken_context_parallel_features"):
            broken, verdicts = reference(layout).judge(*cp, flag)
        assert flag.removeprefix("--use-") in broken.features
        assert verdicts["gradients"].failures, (flag, verdicts["gradients"].worst)


def test_packed_context_parallel_beside_the_distributed_optimizer():
    """The ring on packs with --use-distributed-optimizer against the padded DP2 run: the gradients are recorded in
    the optimizer's shards, so (as the harness does for it) the losses and parameters are judged (measured: 0.004
    and under 0.001 x the limit); attention across samples fails the losses (60 x)."""
    cp = ["--context-parallel-size", "2", "--use-distributed-optimizer"]
    on, verdicts = reference("dp2-rope").judge(*cp)
    for group in ("loss", "parameters"):
        assert verdicts[group].count and not verdicts[group].failures, (group, verdicts[group].failures[:3])
    assert on.memory["feature_statistics"]["context-parallel"]["megatron_cp_algo packed attention calls"] > 0
    with harness.extra_feature_module("broken_context_parallel_features"):
        _, broken = reference("dp2-rope").judge(*cp, "--use-test-broken-cp-packed-across")
    assert broken["loss"].failures, broken["loss"].worst


def test_a_resumed_packed_run_trains_what_the_whole_run_trained(tmp_path):
    """The packs of a step depend on the step's number alone: 1 step, save, resume to 2 equals 2 steps (the whole
    run is test_packed_equals_padded[dp2-rope]'s)."""
    whole = reference("dp2-rope").packed
    run = reference("dp2-rope").on_base
    train.run(checked_args([*run, "--train-iters", "1", "--save", str(tmp_path)]))
    resumed = train.run(checked_args([*run, "--train-iters", "2", "--load", str(tmp_path)]))
    assert resumed.losses == whole.losses[1:] and len(resumed.losses) == 1
    assert whole.memory["packed_attention"]["calls"] > 0


SMALL_VIDEOS = ["--video-min-pixels", str(28 * 28 * 4), "--video-max-pixels", str(28 * 28 * 16)]


def test_a_data_sets_samples_packed_equal_padded_at_dp2(tmp_path_factory):
    """--data-path: each DP rank packs the very samples its unpadded share holds (mm_adaptor.data's rank-contiguous
    share of the seeded permutation), each loaded alone with its own 3-D rope index, images and videos (every
    fourth record a clip: its video tokens and temporal positions packed)."""
    from mm_adaptor.data.shapes import make_shapes

    shapes = make_shapes(str(tmp_path_factory.mktemp("shapes")), count=16, seed=3, videos=4)
    assert sum("videos" in record for record in json.loads(Path(shapes).read_text())) == 4  # read: 2 steps of 8
    model = ["--model", "qwen2_5_vl-tiny", "--data-path", shapes, "--num-layers", "2", "--seq-length", "512",
             "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "2", *SMALL_VIDEOS]
    packed = PackedAgainstPadded(["--nproc-per-node", "2"], model, DATA_SET_TOLERANCE)
    on, verdicts = packed.judge()
    failures = {group: v.failures[:3] for group, v in verdicts.items() if v.failures}
    assert not failures, failures
    assert all(v.count for v in verdicts.values())
    ran = on.memory["packed_attention"]
    assert ran["calls"] > 0 and len(ran["last_cu_seqlens"]) > 2, ran
    with harness.extra_feature_module("broken_packing_features"):
        _, broken = packed.judge("--use-test-packing-across-samples")
    assert broken["gradients"].failures, broken["gradients"].worst
