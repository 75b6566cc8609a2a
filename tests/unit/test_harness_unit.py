import pytest

from mm_adaptor import harness
from mm_adaptor.cli import _split_feature_args
from mm_adaptor.features import Tolerance


def test_tolerance_of_an_exact_feature():
    tol = harness.tolerance_for(["--optimize-vocab-parallel-ce"])
    assert tol.exact and "--optimize-vocab-parallel-ce" in tol.why


def test_no_feature_is_an_error():
    with pytest.raises(harness.HarnessError, match="no feature is switched on"):
        harness.tolerance_for(["--bf16"])


def test_feature_flags_are_split_from_training_flags():
    feats, rest = _split_feature_args(["--bf16", "--optimize-vocab-parallel-ce", "--num-layers", "2"],
                                      {"--optimize-vocab-parallel-ce"})
    assert feats == ["--optimize-vocab-parallel-ce"] and rest == ["--bf16", "--num-layers", "2"]


def test_losses_compared_exactly_or_with_tolerance():
    exact = Tolerance(exact=True)
    assert harness._loss_failures([1.0, 2.0], [1.0, 2.0 + 1e-15], exact) == [2]
    loose = Tolerance(exact=False, rtol=1e-6, atol=0.0)
    assert harness._loss_failures([1.0, 2.0], [1.0, 2.0 + 1e-9], loose) == []


def test_unknown_layout():
    with pytest.raises(harness.HarnessError, match="unknown layout"):
        harness.compare(["--optimize-vocab-parallel-ce"], layout="tp9")
