"""On the installed megatron-core (0.17 or newer): each built-in feature either serves, because the code of every
upstream function it patches equals a release it was verified on, and then passes check against unpatched Megatron
with its wrappers called; or it refuses in one line naming the changed function. Serving features run grouped, as
the pair matrix groups them: one bit-for-bit run of the exact ones, one calibrated run of the others."""

import pytest
from feature_runs import assert_run_passes

from mm_adaptor import contracts, features, versions
from mm_adaptor.harness import composition

pytestmark = pytest.mark.distributed

BUILT_IN = sorted(features.built_in_features(), key=lambda f: f.name)
STATES = {state.name: state for state in versions.feature_states()}
SERVING = [f for f in BUILT_IN if not STATES[f.name].refusals]
REFUSED = [f for f in BUILT_IN if STATES[f.name].refusals]


def runs() -> list[composition.Run]:
    groups = []
    for exact in (True, False):
        members = tuple(f for f in SERVING if f.tolerance.exact == exact)
        if not members:
            continue
        parallel = frozenset({"tp"}).union(*(composition.needs_of(f).parallel for f in members))
        assert composition.refusal(members, parallel) is None, [f.name for f in members]
        groups.append(composition.Run(members, parallel))
    return groups


def test_some_feature_serves_and_the_release_is_past_the_base():
    installed = contracts.installed_version()
    assert installed and not installed.startswith("0.16"), installed
    assert SERVING, "no feature serves here"


@pytest.mark.parametrize("feature", REFUSED, ids=[f.name for f in REFUSED])
def test_a_refused_feature_names_the_changed_function(feature):
    for line in STATES[feature.name].refusals:
        assert "changed in megatron-core" in line or "not defined" in line, line
        assert "megatron." in line, line


@pytest.mark.parametrize("run", runs(), ids=lambda r: ",".join(f.name for f in r.members))
def test_serving_features_pass_check_here(run):
    assert_run_passes(run)
