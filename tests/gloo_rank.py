"""A one-rank gloo megatron for unit tests; its own module, since several test folders have a conftest."""

import contextlib
import os


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


def run_ranks(rank_main, workdir, case: dict, nproc: int = 2) -> list[dict]:
    """Saves case in workdir, runs rank_main(workdir) on nproc CPU gloo ranks (each inside a_rank) and returns
    the results each rank saved."""
    import torch

    from mm_adaptor.ranks.launcher import launch

    torch.save(case, os.path.join(workdir, "case.pt"))
    launch(rank_main, (str(workdir),), nproc=nproc, timeout=300)
    return [torch.load(os.path.join(workdir, f"rank{rank}.pt"), weights_only=False) for rank in range(nproc)]


@contextlib.contextmanager
def a_rank(workdir):
    """In a rank that run_ranks started: the CPU backend and a gloo group of all of them. Yields (case, results): fill
    results, it is saved for the test on the way out."""
    import torch
    import torch.distributed as dist

    from mm_adaptor import devices

    devices.install("cpu")
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    results = {}
    yield torch.load(os.path.join(workdir, "case.pt"), weights_only=False), results
    torch.save(results, os.path.join(workdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@contextlib.contextmanager
def model_parallel(tensor: int, pipeline: int = 1, **sizes):
    """megatron's parallel state for one layout (seeded as the driver seeds it), destroyed on the way out."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor, pipeline, **sizes)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()

