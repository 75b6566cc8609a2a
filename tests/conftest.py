import contextlib
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("PYTHONWARNINGS", "ignore")
# One unpatched baseline per configuration for the whole session (the harness caches it by arguments).
_own_baseline_cache = "MM_ADAPTOR_BASELINE_CACHE" not in os.environ
if _own_baseline_cache:
    os.environ["MM_ADAPTOR_BASELINE_CACHE"] = tempfile.mkdtemp(prefix="mm-adaptor-baselines-")


def pytest_sessionfinish(session, exitstatus):
    if _own_baseline_cache:
        shutil.rmtree(os.environ["MM_ADAPTOR_BASELINE_CACHE"], ignore_errors=True)


@contextlib.contextmanager
def one_gloo_rank():
    """One gloo rank with megatron's model-parallel groups (all of size 1), on the CPU backend."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mm_adaptor import devices
    from mm_adaptor.launcher import free_port

    saved = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    devices.install("cpu")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        devices.uninstall()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def single_rank_megatron():
    with one_gloo_rank():
        yield
