"""Save/load the training driver's state with megatron-core's distributed checkpointing.

A save is written into `iter_N.saving`, renamed to `iter_N` once every rank finished, and only then named by the
marker file (replaced atomically), so the marker always names a complete checkpoint: a save killed half way leaves
a `.saving` directory behind and the marker at the previous checkpoint. The directory layout, and the renames that
publish a save, are in checkpoint_files (no torch, no megatron: argument checks read it before any rank starts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mm_adaptor.train import families
from mm_adaptor.harness.runner.checkpoint_files import (  # noqa: F401  (latest_checkpoint: callers read it here too)
    CONTENTS, MARKER, checkpoint_dir, latest_checkpoint, publish, replace_file)
from mm_adaptor.core import checkpoint_writer
from mm_adaptor.core.wrapped import unwrap


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
    sd = {_model_key(state, i): unwrap(chunk).sharded_state_dict(metadata=metadata)
          for i, chunk in enumerate(state.model)}
    if with_optimizer:
        sd["optimizer"] = state.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=metadata)
        sd["opt_param_scheduler"] = state.scheduler.state_dict()
    sd["iteration"] = state.iteration
    return sd


def save_checkpoint(state, directory: str, *, save_optim: bool = True, save_rng: bool = True) -> Path:
    """save_optim / save_rng False: Megatron-LM's --no-save-optim / --no-save-rng."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from mm_adaptor import devices

    backend = devices.current()  # the rank's, installed before the model was built
    final = checkpoint_dir(directory, state.iteration)
    staging = final.with_name(final.name + ".saving")
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
        staging.mkdir(parents=True)
    backend.barrier()
    checkpoint_writer.fork_results_server()
    dist_checkpointing.save(_sharded_state_dict(state, is_loading=False, with_optimizer=save_optim), str(staging))
    if save_rng:
        _save_rng(staging)
    if dist.get_rank() == 0:
        (staging / CONTENTS).write_text(json.dumps({"optimizer": save_optim, "rng": save_rng,
                                                    "world_size": dist.get_world_size()}))
    backend.barrier()  # every rank has written its shards
    if dist.get_rank() == 0:
        publish(staging, final)
        replace_file(Path(directory) / MARKER, str(state.iteration))
    backend.barrier()
    return final


def load_checkpoint(state, directory: str, *, load_optim: bool = True, load_rng: bool = True) -> int:
    """Load the latest checkpoint under `directory`; returns its iteration.

    load_optim=False (Megatron-LM's --no-load-optim) loads the weights only, e.g. a checkpoint saved before the
    first step or by a model whose optimizer differs; the optimizer's main params are refreshed from them. A
    MindSpeed-MM checkpoint (convert/mindspeed_mm.py) loads its weights only, and its iteration (0 for release)."""
    from megatron.core import dist_checkpointing

    from mm_adaptor.convert.mindspeed_mm import is_mm_checkpoint, load_mm_checkpoint

    if is_mm_checkpoint(directory):  # MindSpeed-MM's torch layout (mm-convert): weights only
        iteration = load_mm_checkpoint(directory, [unwrap(chunk) for chunk in state.model], _metadata(state))
        state.optimizer.reload_model_params()
        return iteration
    path = latest_checkpoint(directory)
    if path is None:
        raise FileNotFoundError(f"no checkpoint under {directory} (missing {MARKER})")
    contents = json.loads((path / CONTENTS).read_text()) if (path / CONTENTS).exists() else None
    if contents is not None and not contents["optimizer"]:
        load_optim = False  # saved with --no-save-optim
    if contents is None and families.of(state.args).loads_converted_checkpoints:
        load_optim = False  # a converted checkpoint: weights only
    loaded = dist_checkpointing.load(_sharded_state_dict(state, is_loading=True, with_optimizer=load_optim), str(path))
    for i, chunk in enumerate(state.model):
        unwrap(chunk).load_state_dict(loaded[_model_key(state, i)])
    if load_optim:
        state.optimizer.load_state_dict(loaded["optimizer"])
        state.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:
        state.optimizer.reload_model_params()
    if load_rng and contents is not None and contents["rng"]:
        _load_rng(path, contents["world_size"])
    return int(loaded["iteration"])




def _rng_file(path: Path) -> Path:
    import torch.distributed as dist

    return path / "rng" / f"rank{dist.get_rank()}.pt"


def _save_rng(path: Path) -> None:
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    file = _rng_file(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}, file)


def _load_rng(path: Path, saved_world_size: int) -> None:
    """Each rank's generators as saved (as Megatron-LM, only when the world size is the same)."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    file = _rng_file(path)
    if saved_world_size != dist.get_world_size() or not file.exists():
        return
    states = torch.load(file, weights_only=False)
    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])
