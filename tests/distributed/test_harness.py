"""The regression harness, `mm-adaptor check`, and the first feature (--optimize-vocab-parallel-ce); the harness's
self-tests: deliberately wrong features it must reject, and the calibration its inexact thresholds rest on."""

import os

import pytest

from mm_adaptor import harness
from mm_adaptor.cli import main as cli_main
from mm_adaptor.harness import calibration

pytestmark = pytest.mark.distributed


def test_optimize_vocab_parallel_ce_is_bit_for_bit_in_every_layout(capsys):
    """In bf16, the dtype it is used in (fp32: its unit test and the feature pairs)."""
    code = cli_main(["check", "--optimize-vocab-parallel-ce", "--layout", "all", "--iters", "4", "--bf16"])
    out = capsys.readouterr().out
    layouts = len(harness.LAYOUTS)
    assert layouts == 7 and "single" in harness.LAYOUTS
    assert f"summary: {layouts}/{layouts} layouts within tolerance" in out, out
    assert code == 0
    assert out.count("verdict: PASS") == layouts
    assert out.count("tolerance: bit-for-bit") == layouts, "the tolerance is printed once per layout"


@pytest.fixture
def broken_features():
    with harness.extra_feature_module("broken_ce_feature"):
        yield


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


SUBTLE_BUGS = {
    # layer 1's MLP activation x 1.002 (computed in fp32, rounded once): half a bf16 ulp, but systematic
    "--use-test-mlp-activation-off": "mlp",
    # every layer's MLP output x 1.002 (its activation computed in fp32, rounded once): every layer, one sign
    "--use-test-every-mlp-output-off": "mlp",
    # layer 1's linear_fc2 weight gradient x 0.98 (Adam hides it from the parameters)
    "--use-test-fc2-wgrad-off": "layers.0.mlp.linear_fc2.weight",
}


# The self-test's layout: tp2-sp here; a machine with one GPU runs it in `single` (scripts/gpu_session.sh verdicts).
SELF_TEST_LAYOUT = os.environ.get("MM_ADAPTOR_SELF_TEST_LAYOUT", "tp2-sp")


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bug", list(SUBTLE_BUGS))
def test_subtle_inexact_bugs_fail(bug, precision):
    """Features that claim the fused kernels' tolerance but are wrong by 0.2% (in one layer or in every layer) or by
    2% in one place must fail."""
    with harness.extra_feature_module("subtle_bug_features"):
        result = harness.compare([bug], layout=SELF_TEST_LAYOUT, extra_args=precision, iters=4)
    assert not result.tolerance.exact
    assert not result.passed, harness.format_comparison(result)
    located = result.activations.failures + result.grads.failures
    assert any(SUBTLE_BUGS[bug] in failure for failure in located), harness.format_comparison(result)
    if bug == "--use-test-every-mlp-output-off":
        for layer in ("L1.mlp", "L2.mlp"):
            assert any(layer in failure for failure in result.activations.failures), harness.format_comparison(result)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_different_rounding_of_the_same_math_passes(precision):
    """The other side of the self-test: a further rounding perturbation (matrix products split at a fifth instead of
    a half or a third) is a legitimate change and must pass against the limits the noise references set; it must
    change something."""
    row, = calibration.calibrate([SELF_TEST_LAYOUT], [precision], ["llama"])
    assert max(row.second.values()) <= 1.0, row
    assert row.noise["gradients"]["rel_norm"] > 0, "the perturbation must change something, or it calibrates nothing"


def test_check_refuses_flags_that_enable_nothing(capsys):
    assert cli_main(["check", "--layout", "tp2", "--iters", "1"]) == 2
    assert "no feature is switched on" in capsys.readouterr().err


def test_calibrate_stores_what_check_then_reads(tmp_path, monkeypatch, capsys):
    """`mm-adaptor calibrate` stores the device's worst legitimate ratio per layout and precision; `check` there
    names it (the same steps: the noise references come from the cache)."""
    import json

    model = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope"]
    assert cli_main(["calibrate", "--layout", "single", "--precision", "fp32", "--model", "llama", "--iters", "2",
                     "--store-dir", str(tmp_path)]) == 0
    stored = json.loads((tmp_path / "cpu.json").read_text())["rows"]["single"]["fp32"]["llama"]
    assert 0 < stored["second"] <= 1.0 and f"stored for cpu in {tmp_path / 'cpu.json'}" in capsys.readouterr().out
    monkeypatch.setenv("MM_ADAPTOR_CALIBRATION_DIR", str(tmp_path))
    assert cli_main(["check", "--use-fused-rmsnorm", "--layout", "single", "--iters", "2", *model]) == 0
    out = capsys.readouterr().out
    assert f"device calibration: cpu single fp32 (llama; {stored['date']}, {tmp_path / 'cpu.json'}): a legitimate " \
           f"rounding change reached {stored['second']:.2f} of the limits\n" in out, out
    assert "noise draws: matrix products in halves, matrix products in thirds\n" in out, out
