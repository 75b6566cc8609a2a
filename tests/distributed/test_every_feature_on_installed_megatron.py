"""On the installed megatron-core (any release of the range: the 0.16.1 leg of the test command runs this file beside
the unit tests; the newest leg leaves its grouped runs to test_feature_pairs.py, which holds them): each built-in
feature either serves, because the code of every upstream function it patches equals a release it was verified on,
and then passes check against unpatched Megatron with its wrappers called; or it refuses in one line naming the
changed function. Serving features run grouped, as the pair matrix groups them: bit-for-bit runs of the exact ones,
then calibrated runs of the others, each run as many of them as validate together."""

import pytest
from feature_runs import assert_run_passes
from packaging.version import Version

from mm_adaptor.versions import contracts

from mm_adaptor.core import features

from mm_adaptor.versions import serving
from mm_adaptor.harness import composition

pytestmark = pytest.mark.distributed

BUILT_IN = sorted(features.built_in_features(), key=lambda f: f.name)
REFUSALS = serving.refusals_here()  # none for --moe-permutation-async-comm on the CPU: it patches nothing there
SERVING = [f for f in BUILT_IN if not REFUSALS[f.name]]
REFUSED = [f for f in BUILT_IN if REFUSALS[f.name]]


def _parallel(members) -> frozenset:
    return frozenset({"tp"}).union(*(composition.needs_of(f).parallel for f in members))


def runs() -> list[composition.Run]:
    """The exact features, then the others: each run takes every remaining feature of its kind that validates with
    those already in it (features that keep the same optimizer state are refused together, so they go to the next
    run)."""
    groups = []
    for exact in (True, False):
        pending = [f for f in SERVING if f.tolerance.exact == exact]
        while pending:
            members: list = []
            for feature in pending:
                if composition.refusal((*members, feature), _parallel((*members, feature))) is None:
                    members.append(feature)
            assert members, [f.name for f in pending]
            groups.append(composition.Run(tuple(members), _parallel(members)))
            pending = [f for f in pending if f not in members]
    return groups


def test_every_feature_serves_on_a_release_it_was_verified_on():
    installed = contracts.installed_version()
    assert SERVING, "no feature serves here"
    series = Version(installed).release[:2]
    verified_here = [f for f in BUILT_IN if any(Version(v).release[:2] == series
                                                for v in contracts.verified_versions(f.name))]
    assert verified_here, f"no feature was verified on a {installed} release: a test leg on an unverified series"
    assert not [f.name for f in verified_here if f in REFUSED], {f.name: REFUSALS[f.name] for f in REFUSED}


def test_a_refused_feature_names_the_changed_function():
    for feature in REFUSED:  # none at either end of the range; a release between may refuse some
        for line in REFUSALS[feature.name]:
            assert "changed in megatron-core" in line or "not defined" in line, line
            assert "megatron." in line, line


@pytest.mark.parametrize("run", runs(), ids=lambda r: ",".join(f.name for f in r.members))
def test_serving_features_pass_check_here(run):
    assert_run_passes(run)
