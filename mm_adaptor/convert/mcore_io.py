"""Megatron distributed checkpoints, written piece by piece and read tensor group by tensor group.

A dist checkpoint (torch_dist backend) is a `.metadata` file (torch.distributed.checkpoint's Metadata: every key's
global shape and its chunks, and where each chunk's bytes lie) beside data files. A layer stack's key has one chunk
per layer, so the converter saves each input shard's tensors with megatron's own dist_checkpointing.save into a
piece of its own, then moves the pieces' data files into one directory and joins their Metadata. Megatron's load
reads the result as if one save had written it (and reshards it to any TP/PP on load)."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
from pathlib import Path

from mm_adaptor.core import checkpoint_writer

MARKER = "latest_checkpointed_iteration.txt"  # what the built-in driver's --load reads (train/checkpoint.py)
ITER_DIR = "iter_0000000"
INFO = "mm_adaptor_convert.json"  # the conversion's layout and family, beside the HF config in hf/


@contextlib.contextmanager
def single_process_group():
    """torch.distributed with one gloo rank, which dist_checkpointing needs (and, without CUDA, the CPU device
    layer, since its writer synchronises CUDA); a no-op when a process group is already up."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    from mm_adaptor import devices
    from mm_adaptor.ranks.process import own_rendezvous

    cpu = not torch.cuda.is_available()
    if cpu:
        devices.install("cpu")
    with own_rendezvous():
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
            checkpoint_writer.stop_results_server()
            if cpu:
                devices.uninstall()


def sharded_tensor(key: str, tensor, offsets: tuple = (), totals: tuple = ()):
    """The ShardedTensor megatron's modules make for this tensor: the chunk at `offsets` of leading axes of sizes
    `totals` (a stack's layer axis, then an expert axis), or the whole key."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    axes = [(axis, offset, total) for axis, (offset, total) in enumerate(zip(offsets, totals))]
    return ShardedTensor.from_rank_offsets(key, tensor, *axes, replica_id=0, prepend_axis_num=len(axes))


def sharded_object(key: str, offsets: tuple = (), totals: tuple = ()):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if not totals:
        return ShardedObject(key, None, (1,), (0,), replica_id=0)
    return ShardedObject(key, None, tuple(totals), tuple(offsets), replica_id=0)


class PieceWriter:
    """Saves groups of tensors as pieces under `staging`, then `finish` joins them into `final`.

    Megatron's save wants every chunk of a key on some rank, so a piece holding layers 3 and 7 of a stack saves
    them as a stack of its own ([2, ...]); `finish` moves those chunks to offsets 3 and 7 of the full stack. A key
    with a layer and an expert axis goes the same way: the piece's (layer, expert) chunks along its first axis (the
    second of size 1), moved to their (layer, expert) offsets."""

    def __init__(self, staging: Path):
        self.staging = Path(staging)
        self.pieces: list[tuple[Path, dict]] = []

    def save(self, tensors: list, objects: list = (), content_metadata: dict | None = None) -> None:
        """tensors: (key, tensor, offsets, totals) as Family.placement gives them; objects: (key, offsets, totals).
        The first piece's common state (content_metadata included) is the checkpoint's."""
        from megatron.core import dist_checkpointing

        stacks: dict[str, list[tuple[int, ...]]] = {}
        position: dict[tuple, int] = {}
        for key, _, offsets, _ in tensors:
            if offsets:
                position[key, tuple(offsets)] = len(stacks.setdefault(key, []))
                stacks[key].append(tuple(offsets))
        sharded = {}
        for n, (key, tensor, offsets, _) in enumerate(tensors):
            if not offsets:
                sharded[f"t{n}"] = sharded_tensor(key, tensor)
            else:
                local = (position[key, tuple(offsets)], *[0] * (len(offsets) - 1))
                sharded[f"t{n}"] = sharded_tensor(key, tensor, local, (len(stacks[key]), *[1] * (len(offsets) - 1)))
        for n, (key, offsets, totals) in enumerate(objects):
            sharded[f"o{n}"] = sharded_object(key, offsets, totals)
        totals = {key: tuple(sizes) for key, _, offsets, sizes in tensors if offsets}
        piece = self.staging / f"piece_{len(self.pieces):05d}"
        piece.mkdir(parents=True)
        checkpoint_writer.fork_results_server()
        dist_checkpointing.save({"model": sharded, "iteration": 0}, str(piece), content_metadata=content_metadata)
        self.pieces.append((piece, {key: (indices, totals[key]) for key, indices in stacks.items()}))

    def finish(self, final: Path) -> None:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        final = Path(final)
        final.mkdir(parents=True, exist_ok=True)
        merged = None
        for k, (piece, stacks) in enumerate(self.pieces):
            with open(piece / ".metadata", "rb") as f:
                meta = pickle.load(f)
            renamed = {}
            for name in sorted(os.listdir(piece)):
                source = piece / name
                if name.endswith(".distcp"):
                    renamed[name] = f"__{k}_{name.split('_')[-1]}"  # __0_j.distcp -> __k_j.distcp
                    os.replace(source, final / renamed[name])
                elif name not in (".metadata", "metadata.json", "common.pt") or k == 0:
                    os.replace(source, final / name)  # sharded objects' folders; piece 0's common state

            for key, (_, totals) in stacks.items():
                storage = meta.state_dict_metadata[key]
                storage.size = type(storage.size)((*totals, *storage.size[len(totals):]))
                for chunk in storage.chunks:
                    chunk.offsets = type(chunk.offsets)(_moved(stacks, key, chunk.offsets))
            storage_data = {}
            for index, info in meta.storage_data.items():
                info.relative_path = renamed[info.relative_path]
                offset = None if index.offset is None else type(index.offset)(_moved(stacks, index.fqn, index.offset))
                storage_data[MetadataIndex(index.fqn, offset)] = info
            meta.storage_data = storage_data
            if merged is None:
                merged = meta
                continue
            for key, storage in meta.state_dict_metadata.items():
                if key in merged.state_dict_metadata:
                    if hasattr(storage, "chunks"):  # a bytes object (each piece saves it: 0.19) has none
                        merged.state_dict_metadata[key].chunks.extend(storage.chunks)
                else:
                    merged.state_dict_metadata[key] = storage
            merged.storage_data.update(meta.storage_data)
            if isinstance(merged.planner_data, dict) and isinstance(meta.planner_data, dict):
                merged.planner_data.update(meta.planner_data)
        # the index hint of each chunk's storage entry: its position in the joined chunk list
        position = {(key, tuple(chunk.offsets)): i for key, storage in merged.state_dict_metadata.items()
                    for i, chunk in enumerate(getattr(storage, "chunks", []))}
        merged.storage_data = {
            MetadataIndex(index.fqn, index.offset, position.get((index.fqn, tuple(index.offset or ())))): info
            for index, info in merged.storage_data.items()}
        with open(final / ".metadata", "wb") as f:
            pickle.dump(merged, f)
        shutil.rmtree(self.staging)


class Reader:
    """Reads one layer (or one expert of a layer) of a key, or a whole plain key, of a torch_dist checkpoint straight
    from its chunks, so memory holds one tensor at a time (megatron's load on one rank wants whole keys). Chunks of
    any layout (this converter's, or a training run's TP/PP/EP slices) are joined."""

    def __init__(self, checkpoint: Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = Path(checkpoint)
        self.meta = FileSystemReader(str(self.path)).read_metadata()

    def tensors(self) -> dict:
        """{key: (global shape, dtype)} of the checkpoint's tensors."""
        return {key: (tuple(storage.size), storage.properties.dtype)
                for key, storage in self.meta.state_dict_metadata.items() if hasattr(storage, "chunks")}

    def read(self, key: str, index=()):
        """The tensor at `index` of the key's leading axes (a layer number, or (layer, expert), or () / None for
        the whole key)."""
        import io

        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        index = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        lead = len(index)
        storage = self.meta.state_dict_metadata[key]
        shape = tuple(storage.size)[lead:]
        out = None
        for chunk in storage.chunks:
            offsets, sizes = list(chunk.offsets), list(chunk.sizes)
            if not all(o <= i < o + n for i, o, n in zip(index, offsets, sizes)):
                continue
            info = self.meta.storage_data[MetadataIndex(key, chunk.offsets)]
            if info.transform_descriptors:
                raise ValueError(f"{key}: stored with transforms {info.transform_descriptors}, not read here")
            with open(self.path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = torch.load(io.BytesIO(f.read(info.length)), map_location="cpu", weights_only=True)
            for i, o in zip(index, offsets):
                data = data[i - o]
            offsets = offsets[lead:]
            if tuple(data.shape) == shape and data.dtype == storage.properties.dtype:
                return data.contiguous()  # one chunk holds it all (as this converter writes): no second copy
            if out is None:
                out = torch.empty(shape, dtype=storage.properties.dtype)
            target = out
            for dim, (start, size) in enumerate(zip(offsets, data.shape)):
                target = target.narrow(dim, start, size)
            target.copy_(data)
        if out is None:
            raise ValueError(f"{key}: no chunk holds {index}")
        return out


def _moved(stacks, fqn, offsets):
    """A piece's offsets in the joined checkpoint: a stacked tensor's local position becomes its global (layer,
    expert) offsets."""
    if fqn not in stacks:
        return offsets
    indices, totals = stacks[fqn]
    return (*indices[offsets[0]], *offsets[len(totals):])


def saved_arguments(load: str):
    """The arguments a Megatron torch_dist save under `load` was trained with (its marker's iteration), or None."""
    marker = Path(load) / MARKER
    if not marker.is_file() or not marker.read_text().strip().isdigit():
        return None
    directory = Path(load) / f"iter_{int(marker.read_text()):07d}"
    if not (directory / "metadata.json").is_file():
        return None
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load_common_state_dict(str(directory)).get("args")
    except Exception:  # noqa: BLE001 - not ours to judge: Megatron's load speaks
        return None
