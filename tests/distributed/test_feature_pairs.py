"""Every accepted pair of features trains together and passes check against unpatched Megatron, in a layout where
both apply; the pairs run in groups (mm_adaptor.harness.composition), each group judged bit-for-bit when all its
features are exact. Each member must have run: its wrappers were called in the run with the features."""

import pytest

from mm_adaptor import harness
from mm_adaptor.harness import composition

pytestmark = pytest.mark.distributed

PLAN = composition.pair_plan()


def feature_ran(calls: dict) -> bool:
    counted = [n for n in calls.values() if n is not None]
    return sum(counted) > 0 if counted else True  # replacements only: applied is all there is to see


@pytest.mark.parametrize("run", PLAN.runs, ids=[",".join(f.name for f in r.members) for r in PLAN.runs])
def test_the_features_of_a_run_train_together_within_their_tolerance(run):
    result = harness.compare(run.feature_args(), extra_args=run.base_args(), nproc=run.nproc, iters=3)
    assert result.passed, harness.format_comparison(result)
    assert result.tolerance.exact == run.exact
    calls = result.memory_on["patch_calls"]
    for feature in run.members:
        assert feature.name in calls, f"{feature.name} was not applied"
        assert feature_ran(calls[feature.name]), f"{feature.name}'s wrappers never ran: {calls[feature.name]}"
