"""Mixture of experts in the trainer: Megatron's MoE arguments reach the model.
- The alltoall dispatcher trains what allgather trains (EP2, EP2 x TP2; losses within 1e-6 relative: the two
  exchange tokens differently, the arithmetic is the same up to reduction order), and --moe-grouped-gemm, served by
  --use-fused-gmm without Transformer Engine, trains what the per-expert GEMMs train.
- The load-balancing loss balances: from a skewed router initialisation (expert 0 takes every token), each MoE
  layer's expert-load spread on the iteration line falls over 50 iterations with --moe-aux-loss-coeff 0.1 and
  does not without it; a broken load balancing whose loss is computed but never added is rejected.
- Qwen3-VL-MoE trains with its checkpoint's router_aux_loss_coef (the tiny preset's: transformers' 0.001)."""

import re

import pytest

from mm_adaptor.harness.compare import extra_feature_module
from trainer_runs import QUICK, relative_differences, scalars, train

pytestmark = pytest.mark.distributed
pytest.importorskip("megatron.training")
pytest.importorskip("tensorboard")

MOE = [*QUICK, "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]


def _losses(tmp_path, name, argv):
    run = train([*argv, "--tensorboard-dir", str(tmp_path / name)])
    assert run.status == 0, run.err[-3000:]
    return scalars(tmp_path / name)


@pytest.mark.parametrize("layout", [
    ["--nproc-per-node", "2", "--expert-model-parallel-size", "2"],
    ["--nproc-per-node", "4", "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
     "--sequence-parallel"],
], ids=["ep2", "ep2-tp2"])
def test_alltoall_trains_what_allgather_trains(tmp_path, layout):
    run = [*layout, *MOE, "--train-iters", "4", "--moe-aux-loss-coeff", "0.01"]
    allgather = _losses(tmp_path, "allgather", [*run, "--moe-token-dispatcher-type", "allgather"])
    alltoall = _losses(tmp_path, "alltoall", [*run, "--moe-token-dispatcher-type", "alltoall"])
    assert sorted(alltoall) == [1, 2, 3, 4]
    assert max(relative_differences(allgather, alltoall).values()) <= 1e-6, (allgather, alltoall)
    if "--tensor-model-parallel-size" not in layout:
        grouped = _losses(tmp_path, "grouped", [*run, "--moe-token-dispatcher-type", "alltoall",
                                                "--moe-grouped-gemm", "--use-fused-gmm"])
        assert max(relative_differences(alltoall, grouped).values()) <= 1e-6, (alltoall, grouped)


SPREAD = re.compile(r"expert load cv per layer: ([^|]+) \|")


def _spread(*extra) -> tuple[float, float]:
    """The mean over the MoE layers of the expert-load spread in iteration 1 and over the last 10 iterations (Megatron
    logs the first iteration, then every 10)."""
    with extra_feature_module("moe_test_features"):
        run = train(["--nproc-per-node", "1", *MOE, "--train-iters", "50", "--log-interval", "10", "--lr", "1e-2",
                     "--test-skewed-router", *extra])
    assert run.status == 0, run.err[-3000:]
    spreads = [[float(item.split(":")[1]) for item in found.split()] for found in SPREAD.findall(run.out)]
    assert len(spreads) == 6, run.out[-2000:]
    return sum(spreads[0]) / len(spreads[0]), sum(spreads[-1]) / len(spreads[-1])


def _assert_balances(first: float, last: float) -> None:
    assert last <= 0.7 * first, (first, last)


@pytest.fixture(scope="module")
def without_aux_loss():
    return _spread()


def test_the_aux_loss_spreads_a_skewed_router_s_tokens(without_aux_loss):
    first, last = _spread("--moe-aux-loss-coeff", "0.1")
    assert first > 0.5  # expert 0 takes every token (0.58 with 4 experts, top-2)
    _assert_balances(first, last)
    first_off, last_off = without_aux_loss
    assert first_off == pytest.approx(first) and last_off >= 0.9 * first_off, without_aux_loss
    with pytest.raises(AssertionError):
        _assert_balances(first_off, last_off)


def test_an_aux_loss_that_is_not_added_is_rejected():
    first, last = _spread("--moe-aux-loss-coeff", "0.1", "--test-aux-loss-not-added")
    with pytest.raises(AssertionError):
        _assert_balances(first, last)


def test_qwen3_vl_moe_trains_with_its_checkpoint_s_router_aux_loss_coefficient():
    run = train(["--nproc-per-node", "2", "--model", "qwen3_vl_moe-tiny", "--expert-model-parallel-size", "2",
                 *QUICK, "--train-iters", "2"])
    assert run.status == 0, run.err[-3000:]
    assert re.search(r"moe_aux_loss_coeff \.+ 0\.001\n", run.out), "Megatron's table of the arguments"
    balancing = [float(value) for value in run.field("load_balancing_loss")]
    assert len(balancing) == 2 and all(value > 0 for value in balancing), balancing
    assert len(run.field("expert load cv per layer")) == 2
