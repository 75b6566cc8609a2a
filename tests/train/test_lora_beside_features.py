"""LoRA beside the features the other LoRA tests do not stack with it (issue 51's "every registered feature trains
with LoRA or is refused with it"): the pipeline's, the optimizer-state and the MoE ones, on one GPT with 4 experts
and adapters on every expert, its base loaded from one whole-model save. Each stack trains to the EP2 run's losses:
- PP2 + VPP2 with --vpp-extra-warmup and --swap-optimizer (measured 0 relative): the base loaded chunk by chunk,
  each chunk's expert adapters named by their global layer (both failed before);
- EP2 with --moe-alltoall-overlap-comm, --moe-permutation-async-comm and --virtual-optimizer: bit for bit;
- TP2 lent to EP2 (--moe-tp-extend-ep, refused by the trainer's own check before) with --balanced-moe-experts
  (measured 7e-8 relative). Broken variant: the hot experts' adapter gradients not returned to their owners.
CoC and --use-fused-gmm are refused with LoRA in one line (tests/train/test_trainer_lora.py)."""

from pathlib import Path

import pytest

from trainer_runs import QUICK, relative_differences, scalars, train

from mm_adaptor.harness.compare import extra_feature_module

pytestmark = pytest.mark.distributed
pytest.importorskip("megatron.training")
pytest.importorskip("tensorboard")

LIMIT = 2e-5  # as test_trainer_lora.py's layout changes
MOE_GPT = [*QUICK, "--global-batch-size", "4", "--micro-batch-size", "1", "--lr", "1e-2", "--swiglu",
           "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear", "--num-layers",
           "4", "--num-experts", "4", "--moe-token-dispatcher-type", "alltoall", "--use-distributed-optimizer"]
ADAPTERS = ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "--lora-r", "4",
            "--lora-alpha", "8", "--train-iters", "3"]
EP2 = ["--expert-model-parallel-size", "2"]
PIPELINE = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
            "--vpp-extra-warmup", "--swap-optimizer"]
OVERLAP = [*EP2, "--moe-alltoall-overlap-comm", "--moe-permutation-async-comm", "--virtual-optimizer"]
EXTENDED = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-tp-extend-ep"]
BALANCED = ["--balanced-moe-experts", "--balanced-moe-hot-expert-num", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (banner, {iteration: lm loss}) of LoRA runs from one base; run(name, *flags) adds one."""
    root = tmp_path_factory.mktemp("lora_beside")
    base = train(["--nproc-per-node", "1", *MOE_GPT, "--train-iters", "1", "--save", str(root / "base"),
                  "--save-interval", "1"])
    assert base.status == 0, base.err[-3000:]
    done = {}

    def run(name, *flags):
        if name not in done:
            found = train(["--nproc-per-node", "2", *MOE_GPT, *ADAPTERS, "--load", str(root / "base"), *flags,
                           "--tensorboard-dir", str(root / name)])
            assert found.status == 0, found.err[-3000:]
            banner = next(line for line in found.out.splitlines() if "features applied:" in line)
            done[name] = banner, scalars(root / name)
        return done[name]

    run("ep2", *EP2)
    return run


def assert_applied(banner, flags):
    for flag in flags:
        if flag.startswith("--") and flag not in ("--use-distributed-optimizer", "--sequence-parallel") and \
                not flag.startswith(("--pipeline", "--num-layers", "--expert-model", "--tensor-model",
                                     "--balanced-moe-hot")):
            assert flag.removeprefix("--") in banner, (flag, banner)


@pytest.mark.parametrize("name, flags, exact", [("pipeline", PIPELINE, False), ("overlap", OVERLAP, True),
                                                ("extended", [*EXTENDED, *BALANCED], False)])
def test_a_stack_trains_the_adapters_as_ep2_does(runs, name, flags, exact):
    _, reference = runs("ep2")
    banner, found = runs(name, *flags)
    assert_applied(banner, flags)
    assert sorted(found) == sorted(reference) == [1, 2, 3]
    if exact:
        assert found == reference
    assert max(relative_differences(reference, found).values()) <= LIMIT, (found, reference)


def test_hot_expert_adapter_gradients_not_returned_are_caught(runs, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "distributed"))  # the harness's broken variant
    _, reference = runs("ep2")
    with extra_feature_module("broken_balanced_moe_feature"):
        banner, broken = runs("broken", *EXTENDED, "--use-test-balanced-moe-gradient-not-returned")
    assert "test-balanced-moe-gradient-not-returned" in banner
    assert max(relative_differences(reference, broken).values()) > 10 * LIMIT, (broken, reference)


def test_every_feature_trains_beside_lora_or_is_refused_with_it():
    """Which test stacks each registered feature with LoRA, or refuses it with LoRA: a new feature must say."""
    from test_trainer_lora import BESIDE_LORA, OPTIMIZER_BESIDE_LORA

    from mm_adaptor.core import features

    elsewhere = {"--moe-zero-memory": "test_trainer_lora.py's expert adapters at EP2",
                 "--context-parallel-size": "test_trainer_lora.py's CP2 layout",
                 "--use-coc": "refused (test_trainer_lora.py)", "--use-fused-gmm": "refused (test_trainer_lora.py)"}
    stacked = {*BESIDE_LORA, *OPTIMIZER_BESIDE_LORA, *PIPELINE, *OVERLAP, *EXTENDED, *BALANCED, *elsewhere}
    assert {f.main_flag.option for f in features.built_in_features()} <= stacked
