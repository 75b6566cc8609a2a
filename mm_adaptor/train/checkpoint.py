"""Save/load the training driver's state with megatron-core's distributed checkpointing."""

from __future__ import annotations

from pathlib import Path

from mm_adaptor.train.model import unwrap


def _metadata(state) -> dict:
    from megatron.core import parallel_state as ps

    return {
        "distrib_optim_sharding_type": "dp_reshardable",
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }


def _model_key(state, index: int) -> str:
    return "model" if len(state.model) == 1 else f"model{index}"


def _sharded_state_dict(state, *, is_loading: bool, with_optimizer: bool = True) -> dict:
    metadata = _metadata(state)
    sd = {_model_key(state, i): unwrap(chunk).sharded_state_dict(metadata=metadata) for i, chunk in enumerate(state.model)}
    if with_optimizer:
        sd["optimizer"] = state.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=metadata)
        sd["opt_param_scheduler"] = state.scheduler.state_dict()
    sd["iteration"] = state.iteration
    return sd


def save_checkpoint(state, directory: str) -> Path:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path = Path(directory) / f"iter_{state.iteration:07d}"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(state, is_loading=False), str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(directory) / "latest_checkpointed_iteration.txt").write_text(str(state.iteration))
    dist.barrier()
    return path


def load_checkpoint(state, directory: str, *, load_optim: bool = True) -> int:
    """Load the latest checkpoint under `directory`; returns its iteration.

    load_optim=False (Megatron-LM's --no-load-optim) loads the weights only, e.g. a checkpoint saved before the
    first step or by a model whose optimizer differs; the optimizer's main params are refreshed from them."""
    from megatron.core import dist_checkpointing

    marker = Path(directory) / "latest_checkpointed_iteration.txt"
    if not marker.exists():
        raise FileNotFoundError(f"no checkpoint under {directory} (missing {marker.name})")
    iteration = int(marker.read_text().strip())
    path = Path(directory) / f"iter_{iteration:07d}"
    loaded = dist_checkpointing.load(_sharded_state_dict(state, is_loading=True, with_optimizer=load_optim), str(path))
    for i, chunk in enumerate(state.model):
        unwrap(chunk).load_state_dict(loaded[_model_key(state, i)])
    if load_optim:
        state.optimizer.load_state_dict(loaded["optimizer"])
        state.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:
        state.optimizer.reload_model_params()
    return int(loaded["iteration"])
