"""Every accepted pair of features trains together and passes check against unpatched Megatron, in a layout where
both apply; the pairs run in groups (mm_adaptor.harness.composition), each group judged bit-for-bit when all its
features are exact. Each member must have run: its wrappers were called in the run with the features."""

import pytest
from feature_runs import assert_run_passes

from mm_adaptor.harness import composition

pytestmark = pytest.mark.distributed

PLAN = composition.pair_plan()


@pytest.mark.parametrize("run", PLAN.runs, ids=[",".join(f.name for f in r.members) for r in PLAN.runs])
def test_the_features_of_a_run_train_together_within_their_tolerance(run):
    assert_run_passes(run)
