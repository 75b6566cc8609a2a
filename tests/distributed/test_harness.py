"""The regression harness, `mm-adaptor check`, and the first feature (--optimize-vocab-parallel-ce)."""

import pytest

from mm_adaptor import harness
from mm_adaptor.cli import main as cli_main

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_optimize_vocab_parallel_ce_is_bit_for_bit_in_every_layout(capsys, precision):
    code = cli_main(["check", "--optimize-vocab-parallel-ce", "--layout", "all", "--iters", "4", *precision])
    out = capsys.readouterr().out
    assert "summary: 6/6 layouts within tolerance" in out, out
    assert code == 0
    assert out.count("verdict: PASS (bit-for-bit") == 6


@pytest.fixture
def broken_features(monkeypatch):
    from mm_adaptor import features

    monkeypatch.setenv(features.EXTRA_FEATURES_ENV, "broken_ce_feature")
    import importlib
    import sys

    if "broken_ce_feature" in sys.modules:  # a previous test registered and then unregistered it
        importlib.reload(sys.modules["broken_ce_feature"])
    else:
        importlib.import_module("broken_ce_feature")  # registers in this process too

    yield
    for name in ("test-broken-forward-ce", "test-broken-backward-ce"):
        features.unregister(name)


def test_wrong_forward_is_caught(broken_features):
    result = harness.compare(["--use-test-broken-forward-ce"], layout="tp2", iters=3)
    assert not result.passed
    assert result.loss_failures, "the wrong forward changes the reported losses"
    # Megatron's CE backward uses softmax and target only, so this bug is visible in the losses alone.
    assert not result.grads.failures


def test_wrong_backward_is_caught_through_gradients(broken_features, capsys):
    code = cli_main(["check", "--use-test-broken-backward-ce", "--layout", "tp2", "--iters", "2"])
    out = capsys.readouterr().out
    assert code == 1
    assert "verdict: FAIL" in out
    result = harness.compare(["--use-test-broken-backward-ce"], layout="tp2", iters=1)
    assert result.loss_failures == [], "one step's loss is computed before the wrong backward runs"
    assert result.grads.failures, "only the gradient comparison can see this bug"


def test_check_refuses_flags_that_enable_nothing(capsys):
    assert cli_main(["check", "--layout", "tp2", "--iters", "1"]) == 2
    assert "no feature is switched on" in capsys.readouterr().err
