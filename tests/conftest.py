import os

import pytest

os.environ.setdefault("PYTHONWARNINGS", "ignore")


@pytest.fixture
def single_rank_megatron(monkeypatch):
    """One gloo rank with megatron's model-parallel groups (all of size 1), on the CPU backend."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mm_adaptor import devices
    from mm_adaptor.launcher import free_port

    devices.install("cpu")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    devices.uninstall()
