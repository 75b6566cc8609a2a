"""--context-parallel-size N --context-parallel-algo X on the local spec against unpatched Megatron without context
parallelism (the same global batch on data-parallel ranks instead): the harness's calibrated verdict on losses,
every step's gradients and the parameters, with the attention calls counted on the way (the mechanism ran).
Ulysses and the ring over 2 ranks, the ring in bf16, hybrid (Ulysses 2 x ring 2) over 4 ranks, the ring beside
TP2 + SP and the distributed optimizer over 4 ranks, the ring on the tiny Qwen2.5-VL and Qwen3-VL. Broken variants
(tests/distributed/broken_context_parallel_features.py) must fail: a ring without its diagonal blocks' causal
mask, Ulysses with the heads gathered in the wrong order. The attention itself is tested alone in
test_context_parallel_attention.py."""

import pytest

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

# test_packing.py's MODEL (its DP2 layouts, 2 steps): the unpatched DP2 runs and their noise runs are the ones its
# padded references cache (tests/distributed runs in one session), here of skewed lengths padded to --seq-length
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--mock-lengths", "skewed"]
BASE = [*MODEL, "--position-embedding-type", "rope"]  # its "dp2-rope" (with --bf16: "dp2-rope-bf16")
ITERS = 2
# where no other file runs the same unpatched configuration
OWN = ["--num-layers", "2", "--seq-length", "64", "--tensor-model-parallel-size", "1"]


def check(algo, extra=(), nproc=2, size=2, ulysses=None, base=BASE, iters=ITERS):
    flags = ["--context-parallel-size", str(size), "--context-parallel-algo", algo]
    flags += ["--ulysses-degree-in-cp", str(ulysses)] if ulysses else []
    result = harness.compare(flags, extra_args=[*base, *extra], iters=iters, nproc=nproc)
    assert result.passed, harness.format_comparison(result)
    assert not result.tolerance.exact
    return result.memory_on["feature_statistics"]["context-parallel"]


@pytest.mark.parametrize("algo,extra", [("ulysses_cp_algo", []), ("megatron_cp_algo", []),
                                        ("megatron_cp_algo", ["--bf16"])], ids=["ulysses", "ring", "ring-bf16"])
def test_two_ranks(algo, extra):
    stats = check(algo, extra)
    assert stats[f"{algo} attention calls"] > 0


@pytest.fixture(scope="module")
def images_and_videos(tmp_path_factory):
    """Shapes records, every second one a clip, at sizes a 256-token row holds."""
    from mm_adaptor.data.shapes import make_shapes

    shapes = make_shapes(str(tmp_path_factory.mktemp("shapes")), count=8, seed=1, videos=2)
    small = [str(28 * 28 * 4), str(28 * 28 * 16)]
    return ["--data-path", shapes, "--seq-length", "256", "--image-min-pixels", small[0], "--image-max-pixels",
            small[1], "--video-min-pixels", small[0], "--video-max-pixels", small[1]]


# qwen3_vl_moe-tiny is not here: its vision path is qwen3_vl-tiny's, MoE layers under CP are test_feature_pairs.py's
@pytest.mark.parametrize("model", ["qwen2_5_vl-tiny", "qwen3_vl-tiny", "internvl-tiny"])
def test_the_tiny_vision_language_models(model, request):
    """The vision tower runs on whole images on every CP rank; the language model takes its part of the embeddings
    (vision rows placed), the multimodal rope its part of the 3-D positions (Qwen3-VL's interleaved one too), and
    Qwen3-VL's DeepStack layers the features of the visual tokens this rank holds. Qwen2.5-VL trains on records of
    images and videos (video tokens, their temporal positions split over the ranks)."""
    if model == "qwen2_5_vl-tiny":
        data = request.getfixturevalue("images_and_videos")
        stats = check("megatron_cp_algo", ["--model", model, "--micro-batch-size", "1", *data], base=OWN, iters=3)
    else:  # test_packing.py's "qwen3-vl-dp2" and "internvl-dp2"
        stats = check("megatron_cp_algo", ["--model", model], base=MODEL)
    assert stats["megatron_cp_algo attention calls"] > 0


def test_hybrid_on_four_ranks():
    stats = check("hybrid_cp_algo", ["--num-attention-heads", "4", "--global-batch-size", "8"], nproc=4, size=4,
                  ulysses=2, base=OWN, iters=3)
    assert stats["hybrid_cp_algo attention calls"] > 0


def test_ring_beside_tp2_sp_and_the_distributed_optimizer():
    """With the distributed optimizer the harness judges losses and parameters (compare._not_comparable)."""
    stats = check("megatron_cp_algo", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                       "--use-distributed-optimizer"], nproc=4, base=OWN, iters=3)
    assert stats["megatron_cp_algo attention calls"] > 0


@pytest.mark.parametrize("broken,algo,extra", [("--use-test-broken-cp-ring-diagonal", "megatron_cp_algo", []),
                                               ("--use-test-broken-cp-ring-diagonal", "megatron_cp_algo", ["--bf16"]),
                                               ("--use-test-broken-cp-ring-scale", "megatron_cp_algo", []),
                                               ("--use-test-broken-cp-ulysses-heads", "ulysses_cp_algo", [])],
                         ids=["ring-diagonal", "ring-diagonal-bf16", "ring-scale", "ulysses-heads"])
def test_broken_variant_fails(broken, algo, extra):
    """The 0.1% softmax-scale error is caught in fp32 (by the gradients); in bf16 even 1% is not: at the tiny
    model's initialisation the scores are near zero, so the scale barely moves the softmax, below bf16's noise."""
    with harness.extra_feature_module("broken_context_parallel_features"):
        result = harness.compare([broken, "--context-parallel-size", "2", "--context-parallel-algo", algo],
                                 extra_args=[*BASE, *extra], iters=ITERS, nproc=2)
    assert not result.passed
