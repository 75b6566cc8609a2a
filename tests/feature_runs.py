"""One grouped run of features (mm_adaptor.harness.composition.Run) against unpatched Megatron: it passes within
its tolerance (bit for bit when every member is exact) and each member's wrappers were called."""

from mm_adaptor import harness


def feature_ran(calls: dict) -> bool:
    counted = [n for n in calls.values() if n is not None]
    return sum(counted) > 0 if counted else True  # replacements only: applied is all there is to see


def assert_run_passes(run, iters: int = 3):
    result = harness.compare(run.feature_args(), extra_args=run.base_args(), nproc=run.nproc, iters=iters)
    assert result.passed, harness.format_comparison(result)
    assert result.tolerance.exact == run.exact
    calls = result.memory_on["patch_calls"]
    for feature in run.members:
        assert feature.name in calls, f"{feature.name} was not applied"
        assert feature_ran(calls[feature.name]), f"{feature.name}'s wrappers never ran: {calls[feature.name]}"
    return result
