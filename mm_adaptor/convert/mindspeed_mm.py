"""MindSpeed-MM's Qwen2.5-VL checkpoints (what `mm-convert Qwen2_5_VLConverter hf_to_mm` writes, and their training
saves in torch format), read straight into this project's Qwen2.5-VL model.

Their layout: DIR/latest_checkpointed_iteration.txt names `release` or an iteration N; DIR/release/ (or
DIR/iter_000000N/) holds one directory per model-parallel rank, `mp_rank_TT` at PP 1 and `mp_rank_TT_PPP` above,
each with model_optim_rng.pt = {'model': state dict, 'checkpoint_version': 3.0} (`model0`, `model1`, ... with
virtual stages, chunk c of stage p being the model's (c * PP + p)-th piece). Each piece numbers its layers from 0.
Their names differ from ours by tower prefix only (RENAMES; the q/k/v rows are megatron's per-group interleaving in
both), and their vision patch embedding keeps the Conv3d kernel's 5-D shape. Their tensor-parallel shards split as
megatron's do (JOIN): column-parallel rows, row-parallel columns, the gated fc1 as gate and up halves.

Nothing here imports torch at module level: the argument checks call is_mm_checkpoint before any rank starts."""

from __future__ import annotations

import math
import re
from pathlib import Path

from mm_adaptor.convert import ConvertError

MARKER = "latest_checkpointed_iteration.txt"
WEIGHTS = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
# their name prefix -> ours
RENAMES = (("image_encoder.encoder.patch_embed.", "vision_model.patch_embed."),
           ("image_encoder.encoder.blocks.layers.", "vision_model.decoder.layers."),
           ("image_encoder.projector.", "vision_projection."),
           ("text_decoder.", "language_model."))
TOWERS = {"vit": "vision_model.decoder.layers.", "llm": "language_model.decoder.layers."}
PATCH_EMBED = "vision_model.patch_embed.proj.weight"
OUTPUT_LAYER = "language_model.output_layer.weight"
LAYER = re.compile(r"^(?P<prefix>.+\.layers\.)(?P<n>\d+)\.(?P<rest>.+)$")
# how tensor-parallel shards join (our names): "gated" = each shard is [gate part; up part]
JOIN = ((re.compile(r".*\.layers\.\d+\.mlp\.linear_fc1\.(weight|bias)$"), "gated"),
        (re.compile(r".*\.layers\.\d+\.self_attention\.linear_qkv\.(weight|bias)$"), 0),
        (re.compile(r"^vision_projection\.encoder\.linear_fc1\.(weight|bias)$"), 0),
        (re.compile(r"^language_model\.(embedding\.word_embeddings|output_layer)\.weight$"), 0),
        (re.compile(r".*\.layers\.\d+\.(self_attention\.linear_proj|mlp\.linear_fc2)\.weight$"), 1),
        (re.compile(r"^vision_projection\.encoder\.linear_fc2\.weight$"), 1))


def ours(name: str) -> str | None:
    """Our name of one of their tensor names (layer numbers as they are), None for a name outside the model."""
    for theirs, mine in RENAMES:
        if name.startswith(theirs):
            return mine + name[len(theirs):]
    return None


def theirs(name: str) -> str:
    for their, mine in RENAMES:
        if name.startswith(mine):
            return their + name[len(mine):]
    raise ConvertError(f"{name}: no MindSpeed-MM name for it")


def _join_kind(name: str):
    return next((kind for pattern, kind in JOIN if pattern.match(name)), None)


def join(name: str, shards: list):
    """The whole tensor of our `name` from its tensor-parallel shards (rank order)."""
    import torch

    kind = _join_kind(name)
    if kind is None or len(shards) == 1:
        return shards[0]
    if kind == "gated":
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([half[0] for half in halves] + [half[1] for half in halves], dim=0)
    return torch.cat(shards, dim=kind)


def split(name: str, tensor, tp: int) -> list:
    """The inverse of join: the tensor-parallel shards of a whole tensor (copies)."""
    import torch

    kind = _join_kind(name)
    if kind is None:
        return [tensor.clone() for _ in range(tp)]
    if kind == "gated":
        gate, up = tensor.chunk(2, dim=0)
        return [torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0))]
    return [part.clone() for part in tensor.chunk(tp, dim=kind)]


def _iteration_dir(root: Path) -> tuple[Path, int]:
    """(the directory the marker names, its iteration: 0 for release)."""
    text = (root / MARKER).read_text().strip()
    if text == "release":
        return root / "release", 0
    if not text.isdigit():
        raise ConvertError(f"{root / MARKER} says {text!r}: expected release or an iteration number")
    return root / f"iter_{int(text):07d}", int(text)


def is_mm_checkpoint(path) -> bool:
    """Whether `path` is in MindSpeed-MM's torch layout: its marker names a directory of mp_rank_* directories.
    Reads two directory listings, no tensor."""
    root = Path(path)
    if not (root / MARKER).is_file():
        return False
    try:
        directory, _ = _iteration_dir(root)
    except (ConvertError, OSError):
        return False
    return directory.is_dir() and any(RANK_DIR.match(p.name) for p in directory.iterdir())


def holds_their_names(path) -> bool:
    """Whether a torch-layout checkpoint (is_mm_checkpoint) holds MindSpeed-MM's tensor names (mm-convert's, their
    training saves) rather than this project's (a Megatron torch-format save of the trainer). Reads the first
    shard's key names, memory-mapped."""
    import torch

    directory, _ = _iteration_dir(Path(path))
    first = next(entry for entry in sorted(directory.iterdir()) if RANK_DIR.match(entry.name))
    content = torch.load(first / WEIGHTS, map_location="cpu", mmap=True, weights_only=False)
    state = content.get("model") or content.get("model0") or {}
    return any(name.startswith(tuple(their for their, _ in RENAMES)) for name in state)


class MMCheckpoint:
    """One MindSpeed-MM checkpoint, its files opened lazily (memory-mapped): the grid of shards, the layer counts of
    each pipeline piece, and whole tensors under our names with global layer numbers."""

    def __init__(self, path):
        self.root = Path(path)
        if not (self.root / MARKER).is_file():
            raise ConvertError(f"{self.root}: no {MARKER} (a MindSpeed-MM checkpoint names release or an iteration "
                               "in it)")
        self.directory, self.iteration = _iteration_dir(self.root)
        if not self.directory.is_dir():
            raise ConvertError(f"{self.root / MARKER} names {self.directory.name}, which is missing")
        grid = {}
        for entry in sorted(self.directory.iterdir()):
            found = RANK_DIR.match(entry.name)
            if found:
                if found[3] is not None:
                    raise ConvertError(f"{entry}: expert-parallel shards (mp_rank_TT_PPP_EEE): Qwen2.5-VL has no "
                                       "experts")
                grid[int(found[1]), int(found[2] or 0)] = entry / WEIGHTS
        if not grid:
            raise ConvertError(f"{self.directory}: no mp_rank_TT or mp_rank_TT_PPP directories")
        self.tp = 1 + max(t for t, _ in grid)
        self.pp = 1 + max(p for _, p in grid)
        for t in range(self.tp):
            for p in range(self.pp):
                name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if self.pp > 1 else "")
                if not grid.get((t, p), Path("/nonexistent")).is_file():
                    raise ConvertError(f"{self.directory / name / WEIGHTS}: missing (the shards are {self.tp} "
                                       f"tensor x {self.pp} pipeline ranks)")
        self.files = grid
        self._loaded: dict = {}
        self._index()

    def _file(self, t: int, p: int) -> dict:
        import torch

        if (t, p) not in self._loaded:
            path = self.files[t, p]
            try:  # a training save also pickles its arguments and RNG states: their own file, read as Megatron does
                content = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
            except Exception as error:
                raise ConvertError(f"{path}: not a torch checkpoint ({type(error).__name__}: {error})") from None
            keys = sorted(k for k in content if k == "model" or re.fullmatch(r"model\d+", str(k))) \
                if isinstance(content, dict) else []
            if not keys:
                raise ConvertError(f"{path}: no 'model' state dict (expected {{'model': ..., 'checkpoint_version': "
                                   f"{CHECKPOINT_VERSION}}})")
            self._loaded[t, p] = {k: content[k] for k in keys}
        return self._loaded[t, p]

    def _index(self) -> None:
        """pieces: (stage, model key) in the model's order; per piece its layer count per tower; names: our global
        name -> (stage, model key, their local name)."""
        chunks = sorted(self._file(0, 0), key=lambda k: int(k[5:] or 0))
        self.pieces = [(p, key) for key in chunks for p in range(self.pp)]
        self.layers, self.names = [], {}
        start = {tower: 0 for tower in TOWERS}
        for p, key in self.pieces:
            state = self._file(0, p).get(key)
            if state is None:
                raise ConvertError(f"{self.files[0, p]}: no {key!r} (stage 0 has it)")
            numbers = {tower: set() for tower in TOWERS}
            local = {}
            for name in state:
                if name.endswith("._extra_state"):
                    continue
                mine = ours(name)
                if mine is None:
                    raise ConvertError(f"{self.files[0, p]}: unknown tensor {name} (a Qwen2.5-VL checkpoint of "
                                       "mm-convert has image_encoder.* and text_decoder.* tensors)")
                local[mine] = name
                for tower, prefix in TOWERS.items():
                    if mine.startswith(prefix):
                        numbers[tower].add(int(LAYER.match(mine)["n"]))
            counts = {}
            for tower, found in numbers.items():
                if found and found != set(range(len(found))):
                    raise ConvertError(f"{self.files[0, p]} [{key}]: {TOWERS[tower]} numbers {sorted(found)}, "
                                       f"expected 0 to {len(found) - 1} (each pipeline stage numbers its layers "
                                       "from 0)")
                counts[tower] = len(found)
            for mine, name in local.items():
                found = LAYER.match(mine)
                tower = next((t for t, prefix in TOWERS.items() if mine.startswith(prefix)), None)
                if tower is not None:
                    mine = f"{found['prefix']}{start[tower] + int(found['n'])}.{found['rest']}"
                if mine in self.names:
                    raise ConvertError(f"{self.files[0, p]}: {name} is also on an earlier stage")
                self.names[mine] = (p, key, name)
            self.layers.append(counts)
            for tower in TOWERS:
                start[tower] += counts[tower]
        self.totals = start

    def _shards(self, name: str) -> list:
        """The tensor-parallel shards of our global `name` (memory-mapped, rank order)."""
        p, key, local = self.names[name]
        shards = []
        for t in range(self.tp):
            state = self._file(t, p).get(key, {})
            if local not in state:
                raise ConvertError(f"{self.files[t, p]}: no {local} (tensor-parallel rank 0 has it)")
            shards.append(state[local])
        return shards

    def whole(self, name: str):
        """The whole tensor of our global `name`, its tensor-parallel shards joined."""
        return join(name, self._shards(name))

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole shape of our global `name` as the reader gives it, from the shards' shapes alone."""
        shapes = [tuple(shard.shape) for shard in self._shards(name)]
        kind = _join_kind(name)
        whole = list(shapes[0])
        if kind is not None and self.tp > 1:
            axis = 0 if kind == "gated" else kind
            whole[axis] = sum(shape[axis] for shape in shapes)
        return (whole[0], math.prod(whole[1:])) if name == PATCH_EMBED else tuple(whole)

    def tensors(self, tied: bool) -> dict:
        """{our global name: whole tensor}, as `hf_to_mcore_tensors` names them (the patch embedding as a Linear
        weight; a tied model's copy of the embedding on the last stage dropped)."""
        out = {}
        for name in self.names:
            if tied and name == OUTPUT_LAYER:
                continue
            out[name] = _whole(self, name)
        return out


def _key(name: str) -> tuple[str, int | None]:
    """The dist-checkpoint key of our global name and its layer (None outside the layer stacks), as megatron's
    sharded_state_dict asks for it (rules.Rule.sharded_key)."""
    from mm_adaptor.convert.rules import Rule

    found = LAYER.match(name)
    if not found:
        return name, None
    return Rule(f"{found['prefix']}{{i}}.{found['rest']}", (), stack="layers").sharded_key(), int(found["n"])


def load_mm_checkpoint(path, models: list, metadata: dict | None = None) -> int:
    """Loads the checkpoint into this rank's model chunks (megatron modules; any TP/PP of ours, whatever TP/PP they
    wrote: each tensor this rank holds is cut from the whole one, by global layer number). Refuses (ConvertError,
    one line) a layer count or a shape the model contradicts, naming the first tensor. Returns the checkpoint's
    iteration (0 for release)."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    checkpoint = MMCheckpoint(path)
    by_key = {_key(name): name for name in checkpoint.names}
    metadata = {"singleton_local_shards": False, **(metadata or {})}
    cache: dict = {}  # one whole tensor at a time (a swiglu fc1 asks twice)

    def fill(item):
        if isinstance(item, ShardedObject):
            return None  # the linear layers' _extra_state: nothing to restore
        if not isinstance(item, ShardedTensor):
            return item
        lead = item.prepend_axis_num
        layer = item.global_offset[0] if lead else None
        name = by_key.get((item.key, layer))
        if name is None:
            where = f" layer {layer}" if layer is not None else ""
            raise ConvertError(f"{path}: no tensor for the model's {item.key}{where} (the checkpoint has "
                               f"{checkpoint.totals['vit']} vision and {checkpoint.totals['llm']} language layers)")
        if lead and item.global_shape[0] != checkpoint.totals[_tower(name)]:
            raise ConvertError(f"{path}: {checkpoint.totals[_tower(name)]} layers under {TOWERS[_tower(name)]}, "
                               f"the model has {item.global_shape[0]}")
        if name not in cache:
            cache.clear()
            cache[name] = _whole(checkpoint, name)
        whole = cache[name]
        shape = tuple(item.global_shape[lead:])
        if tuple(whole.shape) != shape:
            raise ConvertError(f"{path}: {checkpoint.names[name][2]} has shape {tuple(whole.shape)}, the model's "
                               f"{name} is {shape}")
        part = whole
        for dim, (start, size) in enumerate(zip(item.global_offset[lead:], item.local_shape)):
            part = part.narrow(dim, start, size)
        return part.to(item.dtype if item.dtype is not None else part.dtype)

    for model in models:
        request, nonpersistent, factories = load_preprocess(model.sharded_state_dict(metadata=metadata))
        dict_list_map_inplace(fill, request)
        loaded = apply_factory_merges(request, factories)
        merge(loaded, nonpersistent)
        with torch.no_grad():
            model.load_state_dict(loaded, strict=True)
    return checkpoint.iteration


def expected_shapes(hf_config) -> dict:
    """Our global names -> whole shapes of the Qwen2.5-VL model that `hf_config` describes (transformers' model on
    the meta device, through the converter's rules)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from mm_adaptor.convert import family_for, hf_to_mcore_tensors
    from mm_adaptor.models.hf_config import config_dict

    config = config_dict(hf_config)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig.from_dict(config))
    hf = {name: t for name, t in model.state_dict().items() if name != "lm_head.weight" or not _tied(config)}
    return {name: tuple(t.shape) for name, t in hf_to_mcore_tensors(family_for(config), hf).items()}


def _tied(config) -> bool:
    from mm_adaptor.models.hf_config import tied

    return tied(config)


def check_mm_checkpoint(path, hf_config) -> MMCheckpoint:
    """Refuses (ConvertError, one line) a checkpoint that contradicts the model `hf_config` describes: its layer
    counts, then the first tensor whose shape differs, the first the model lacks or has and the checkpoint not.
    Reads the shards' shapes only (memory-mapped); for the checks before any rank starts."""
    checkpoint = MMCheckpoint(path)
    expected = expected_shapes(hf_config)
    for tower, prefix in TOWERS.items():
        layers = len({LAYER.match(name)["n"] for name in expected if name.startswith(prefix)})
        if checkpoint.totals[tower] != layers:
            raise ConvertError(f"{path}: {checkpoint.totals[tower]} layers under {theirs(prefix)}, the model has "
                               f"{layers}")
    found = {name for name in checkpoint.names if not (name == OUTPUT_LAYER and _tied(hf_config))}
    for name, shape in expected.items():
        if name not in found:
            raise ConvertError(f"{path}: no {theirs(name)} (the model's {name})")
        if checkpoint.shape(name) != shape:
            raise ConvertError(f"{path}: {checkpoint.names[name][2]} has shape {checkpoint.shape(name)}, the "
                               f"model's {name} is {shape}")
    extra = sorted(found - expected.keys())
    if extra:
        raise ConvertError(f"{path}: {checkpoint.names[extra[0]][2]} is not in the model")
    return checkpoint


def _tower(name: str) -> str:
    return next(t for t, prefix in TOWERS.items() if name.startswith(prefix))


def _whole(checkpoint: MMCheckpoint, name: str):
    tensor = checkpoint.whole(name)
    return tensor.flatten(1) if name == PATCH_EMBED else tensor
