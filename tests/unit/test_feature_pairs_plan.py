"""The pair matrix's plan, before anything trains: every pair of registered features is refused in one line naming
both flags, or covered by a run of tests/distributed/test_feature_pairs.py; a feature registered later joins it."""

import itertools

import pytest

from mm_adaptor.core import features
from mm_adaptor.core.features import Feature, Flag, fused_kernel_tolerance, register
from mm_adaptor.harness import composition


def all_pairs(feats):
    return {tuple(sorted((a.name, b.name))) for a, b in itertools.combinations(feats, 2)}


@pytest.fixture(scope="module")
def plan():
    return composition.pair_plan()


def test_every_pair_is_refused_or_covered_by_a_run(plan):
    refused, covered = set(plan.refused), plan.covered()
    assert not refused & covered
    assert refused | covered == all_pairs(features.all_features())


def test_a_refused_pair_says_so_in_one_line_naming_both_flags(plan):
    by_name = {f.name: f for f in features.all_features()}
    assert plan.refused, "the optimizer-state owners refuse each other"
    for (a, b), reason in plan.refused.items():
        assert "\n" not in reason, reason
        for name in (a, b):
            assert by_name[name].main_flag.option in reason, (name, reason)


def test_reuse_with_virtual_optimizer_is_accepted_and_swap_with_either_refused(plan):
    assert ("reuse-fp32-param", "virtual-optimizer") in plan.covered()
    assert ("reuse-fp32-param", "swap-optimizer") in plan.refused
    assert ("swap-optimizer", "virtual-optimizer") in plan.refused


def test_a_run_of_exact_features_stays_exact_and_every_run_validates(plan):
    """Exact pairs are judged bit-for-bit: some run of exact features covers each of them."""
    exact_pairs = {p for p in plan.covered() if all(features.get(n).tolerance.exact for n in p)}
    assert exact_pairs <= {p for run in plan.runs if run.exact for p in run.pairs}
    for run in plan.runs:
        assert composition.refusal(run.members, run.parallel) is None, run.describe()
        assert {f.name for f in run.members} >= {n for p in run.pairs for n in p}


def test_each_pair_mode_has_one_run_per_accepted_pair(plan):
    single = composition.pair_plan(each_pair=True)
    assert single.refused == plan.refused
    assert sorted(p for run in single.runs for p in run.pairs) == sorted(plan.covered())
    assert all(len(run.members) == 2 for run in single.runs)


def test_a_feature_registered_later_joins_the_matrix():
    @register
    class LateFeature(Feature):
        name = "test-late-feature"
        description = "registered by a test"
        flags = (Flag("--use-test-late-feature", description),)
        tolerance = fused_kernel_tolerance("a test feature")

        def patch_sets(self, options):
            return []

    try:
        plan = composition.pair_plan()
        others = [f.name for f in features.all_features() if f.name != LateFeature.name]
        late_pairs = {tuple(sorted((LateFeature.name, n))) for n in others}
        assert late_pairs <= plan.covered() | set(plan.refused)
        assert any(LateFeature.name in {f.name for f in run.members} for run in plan.runs)
    finally:
        features.unregister(LateFeature.name)
