"""A one-rank gloo megatron for unit tests; its own module, since several test folders have a conftest."""

import contextlib
import os


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
