import os
import shutil
import tempfile

import pytest

from gloo_rank import one_gloo_rank

os.environ.setdefault("PYTHONWARNINGS", "ignore")
# One unpatched baseline per configuration for the whole session (the harness caches it by arguments).
_own_baseline_cache = "MM_ADAPTOR_BASELINE_CACHE" not in os.environ
if _own_baseline_cache:
    os.environ["MM_ADAPTOR_BASELINE_CACHE"] = tempfile.mkdtemp(prefix="mm-adaptor-baselines-")


def pytest_sessionfinish(session, exitstatus):
    if _own_baseline_cache:
        shutil.rmtree(os.environ["MM_ADAPTOR_BASELINE_CACHE"], ignore_errors=True)


@pytest.fixture
def single_rank_megatron():
    with one_gloo_rank():
        yield
