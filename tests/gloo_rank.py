"""A one-rank gloo megatron for unit tests; its own module, since several test folders have a conftest."""

import contextlib


@contextlib.contextmanager
def one_gloo_rank():
    """One gloo rank with megatron's model-parallel groups (all of size 1), on the CPU backend."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mm_adaptor import devices
    from mm_adaptor.ranks.process import own_rendezvous

    with own_rendezvous():
        devices.install("cpu")
        dist.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
            devices.uninstall()
