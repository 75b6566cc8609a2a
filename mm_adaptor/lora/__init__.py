"""LoRA fine-tuning on the Megatron models (MindSpeed-MM's flags): which linears get adapters, the base frozen, and
checkpoints that hold the adapters alone.

- Targets match as in peft (and so in MindSpeed-MM, which hands them to peft): a module whose name is the target or
  ends with `.target`, e.g. `linear_qkv` in the language model and in the vision tower alike. A tower the run freezes
  (--freeze-vision, --freeze-language, a frozen projector) gets no adapters, as MindSpeed-MM leaves out frozen
  modules.
- Every other parameter is frozen before Megatron wraps the model: no gradient buffer, no optimizer state.
- The model's sharded state dict (what Megatron saves and loads) is the adapters' alone; the base comes from
  --load-base-model (or, on a first run, from --load, as MindSpeed-MM reads it) through `load_base`."""

from __future__ import annotations

from dataclasses import dataclass

from mm_adaptor.lora.layers import LORA_A, LORA_B, AdapterShape, add_adapter, is_adapter_key, unsupported

__all__ = ["LORA_A", "LORA_B", "AdapterShape", "Settings", "apply", "is_adapter_key", "settings_from_args"]

# MindSpeed-MM's names for separate q/k/v and gate/up adapters on its canonical (unfused) structure
CANONICAL_NAMES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


@dataclass(frozen=True)
class Settings:
    targets: tuple[str, ...]
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    seed: int = 1234
    frozen_towers: tuple[str, ...] = ()  # top-level modules that get no adapters


def targets_of(value) -> tuple[str, ...]:
    """--lora-target-modules as given: names apart or joined by commas (MindSpeed-MM takes both)."""
    if not value:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    return tuple(name.strip() for item in items for name in str(item).split(",") if name.strip())


def enabled(args) -> bool:
    return bool(targets_of(getattr(args, "lora_target_modules", None)))


def settings_from_args(args) -> Settings:
    towers = (["vision_model"] if getattr(args, "freeze_vision", False) else [])
    towers += ["language_model"] if getattr(args, "freeze_language", False) else []
    towers += ["vision_projection"] if getattr(args, "freeze_projector", False) else []
    return Settings(targets=targets_of(args.lora_target_modules), r=args.lora_r, alpha=float(args.lora_alpha),
                    dropout=args.lora_dropout, seed=args.seed, frozen_towers=tuple(towers))


def argument_problems(args) -> list[str]:
    """The LoRA flags' problems before anything is built (one line each)."""
    if not enabled(args):
        given = [flag for flag, dest in (("--load-base-model", "load_base_model"),
                                         ("--lora-register-forward-hook", "lora_register_forward_hook"))
                 if getattr(args, dest, None) is not None]
        return [f"{', '.join(given)}: LoRA is off (no --lora-target-modules): drop it or name the targets"] if given \
            else []
    problems = []
    canonical = [name for name in targets_of(args.lora_target_modules) if name in CANONICAL_NAMES]
    if canonical:
        problems.append(f"--lora-target-modules {' '.join(canonical)}: MindSpeed-MM's separate q/k/v and gate/up "
                        "adapters need its unfused model; here linear_qkv and linear_fc1 carry one adapter each (its "
                        "export to Hugging Face's q_proj/k_proj/v_proj and gate_proj/up_proj is exact): give "
                        "linear_qkv and linear_fc1")
    if args.lora_r < 1:
        problems.append(f"--lora-r {args.lora_r}: the adapters' rank must be at least 1")
    if not 0 <= args.lora_dropout < 1:
        problems.append(f"--lora-dropout {args.lora_dropout}: a probability, 0 to below 1")
    if getattr(args, "ckpt_format", "torch_dist") not in ("torch_dist", None):
        problems.append(f"--ckpt-format {args.ckpt_format}: LoRA checkpoints hold the adapters alone, as a "
                        "distributed checkpoint (any TP/PP layout reads them): give --ckpt-format torch_dist")
    return problems


def model_problems(args) -> list[str]:
    """What LoRA cannot do on the model the arguments describe (its shape set): adapters on MoE experts."""
    if not enabled(args):
        return []
    experts = [name for name in targets_of(args.lora_target_modules) if name in ("linear_fc1", "linear_fc2")]
    grouped = [flag for flag, dest in (("--moe-grouped-gemm", "moe_grouped_gemm"), ("--use-fused-gmm", "use_fused_gmm"))
               if getattr(args, dest, False)]
    if experts and getattr(args, "num_experts", None) and grouped:
        return [f"--lora-target-modules {' '.join(experts)} with {' '.join(grouped)}: these name the experts' linears "
                "too, whose adapters run expert by expert (megatron's SequentialMLP), where grouped GEMMs take the "
                f"experts' weights whole: drop {' '.join(grouped)}, or name the dense MLPs' alone "
                f"({' '.join('mlp.' + name for name in experts)})"]
    return []


def matches(name: str, targets) -> str | None:
    """The target a module's name matches (peft's rule: the name itself, or ending in `.target`), or None."""
    for target in targets:
        if name == target or name.endswith(f".{target}"):
            return target
    return None


def gated_fc1(model, name: str) -> bool:
    """Whether `name` is a gated MLP's linear_fc1 (rows [gate; up]), from its parent MLP's config."""
    parent_name, _, leaf = name.rpartition(".")
    if leaf != "linear_fc1":
        return False
    parent = model.get_submodule(parent_name) if parent_name else model
    config = getattr(parent, "config", None)
    return bool(getattr(config, "gated_linear_unit", False))


def global_name(model, name: str) -> str:
    """The module's name with each layer's index its global one (its TransformerLayer's layer_number - 1): what
    it is called in the whole model, whichever pipeline stage holds it (the adapters' initial values follow it)."""
    local = name.split(".")  # the submodules are looked up by these (local) indices
    parts = list(local)
    for i in range(1, len(parts)):
        if local[i - 1] == "layers" and local[i].isdigit():
            number = getattr(model.get_submodule(".".join(local[:i + 1])), "layer_number", None)
            if number is not None:
                parts[i] = str(number - 1)
        elif local[i - 1] == "local_experts" and local[i].isdigit():  # the expert's global number
            experts = model.get_submodule(".".join(local[:i - 1]))
            group = getattr(experts, "ep_group", None)
            offset = group.rank() * experts.num_local_experts if group is not None else 0
            parts[i] = str(offset + int(local[i]))
    return ".".join(parts)


def candidates(model, settings: Settings) -> tuple[dict[str, object], set[str]]:
    """The megatron linears the targets name, outside frozen towers (name -> module), and the targets that named
    one. ValueError names a module the targets hit that takes no adapter."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    found: dict[str, object] = {}
    hit: set[str] = set()
    for name, module in model.named_modules():
        target = matches(name, settings.targets)
        if target is None or name.split(".")[0] in settings.frozen_towers:
            continue
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            raise ValueError(f"--lora-target-modules {target}: {name} is a {type(module).__name__}, not a "
                             "megatron tensor-parallel linear: name linears (linear_qkv, linear_proj, linear_fc1, "
                             "linear_fc2)")
        problem = unsupported(module)
        if problem:
            raise ValueError(f"--lora-target-modules {target}: {name} takes no adapter: {problem}")
        found[name] = module
        hit.add(target)
    return found, hit


def apply(model, settings: Settings, require_every_target: bool = True) -> dict:
    """Adapters on the targeted linears of one model chunk, everything else frozen. Returns what was done (counts
    for the banner). A pipeline stage may hold none of a target's modules: the caller checks the union."""
    chosen, hit = candidates(model, settings)
    missing = [target for target in settings.targets if target not in hit]
    if require_every_target and missing:
        raise ValueError(f"--lora-target-modules {' '.join(missing)}: no module of the model is named so (outside "
                         "frozen towers)")
    for param in model.parameters():
        param.requires_grad_(False)
    for name, module in chosen.items():
        shape = AdapterShape(settings.r, settings.alpha, settings.dropout, gated_fc1(model, name))
        add_adapter(module, shape, settings.seed, global_name(model, name))
    recomputed_blocks_take_gradients(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"lora_modules": sorted(chosen), "lora_targets_hit": sorted(hit), "trainable_elements": trainable,
            "total_elements": total}


def recomputed_blocks_take_gradients(model) -> int:
    """Megatron's full recompute runs each layer group through a reentrant checkpoint, whose output needs a
    gradient only when an input does: behind a frozen embedding (or patch embedding) no input does, and the
    adapters inside would get no gradient at all. A block that recomputes fully gets hidden states that need one
    (MindSpeed-MM's --lora-register-forward-hook does the same on the embeddings). Returns the blocks hooked."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    hooked = 0
    for module in model.modules():
        if isinstance(module, TransformerBlock) and getattr(module.config, "recompute_granularity", None) == "full":
            module.register_forward_pre_hook(_hidden_states_take_gradients, with_kwargs=True)
            hooked += 1
    return hooked


def _hidden_states_take_gradients(_module, args, kwargs):
    import torch

    def needing(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not tensor.requires_grad:
            return tensor.detach().requires_grad_(True)
        return tensor

    if args:
        return (needing(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": needing(kwargs["hidden_states"])}
    return None


def adapters_only(model) -> None:
    """Megatron saves and loads this chunk's adapters alone (its sharded state dict filtered); sharded_entries reads
    the whole one."""
    whole = model.sharded_state_dict

    def sharded_state_dict(*args, **kwargs):
        return {key: entry for key, entry in whole(*args, **kwargs).items() if is_adapter_key(key)}

    model.lora_whole_sharded_state_dict = whole
    model.sharded_state_dict = sharded_state_dict


def sharded_entries(model, metadata=None, *, adapters: bool) -> dict:
    """The chunk's sharded state dict: its adapters' entries alone, or (adapters=False) all but them, what a base
    checkpoint must hold."""
    whole = getattr(model, "lora_whole_sharded_state_dict", model.sharded_state_dict)
    return {key: entry for key, entry in whole(metadata=metadata).items() if is_adapter_key(key) == adapters}


def _stored_checkpoint(directory) -> str:
    """The Megatron checkpoint under `directory` (its marker's iteration)."""
    from pathlib import Path

    from mm_adaptor.convert.mcore_to_hf import checkpoint_path

    return str(checkpoint_path(Path(directory)))


def _load_into(model, request: dict, checkpoint: str) -> tuple[dict, list[str]]:
    """Megatron's dist load of `request` from `checkpoint`, copied into the model; returns the loaded tensors and
    the model's keys left unloaded."""
    from megatron.core import dist_checkpointing

    # one model chunk at a time: under a virtual pipeline the ranks together ask for part of the stored layers,
    # which megatron's access check takes for a broken sharding (what the model misses is checked here instead)
    loaded = dist_checkpointing.load({"model": request}, checkpoint, validate_access_integrity=False)["model"]
    return loaded, model.load_state_dict(loaded, strict=False).missing_keys


def checkpoint_metadata() -> dict:
    from megatron.core import parallel_state as ps

    return {"singleton_local_shards": False, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}


def load_base(model, directory) -> int:
    """This chunk's base weights from the Megatron checkpoint under `directory` (a converted one, or a full
    training save: its marker's iteration), resharded to this run's layout by Megatron's dist checkpointing.
    Returns the tensors loaded; ValueError names a tensor the checkpoint lacks."""
    from megatron.core import dist_checkpointing

    checkpoint = _stored_checkpoint(directory)
    request = sharded_entries(model, checkpoint_metadata(), adapters=False)
    stored = set(dist_checkpointing.load_tensors_metadata(checkpoint))
    for key, entry in request.items():
        sharded_key = getattr(entry, "key", None)
        if sharded_key is not None and not key.endswith("_extra_state") and sharded_key not in stored:
            raise ValueError(f"--load-base-model {directory}: its checkpoint has no {sharded_key}: it is not this "
                             "model's base (or holds adapters alone)")
    loaded, unloaded = _load_into(model, request, checkpoint)
    missing = [key for key in unloaded if not is_adapter_key(key) and not key.endswith("_extra_state")]
    if missing:
        raise ValueError(f"--load-base-model {directory}: {missing[0]} was not loaded")
    return len(loaded)


def checkpoint_settings(directory, seed: int = 0) -> Settings:
    """The Settings a LoRA checkpoint was made with: a LoRA run's arguments (its common state), or a conversion's
    record (mm_adaptor_convert.json). ValueError when it holds no adapters."""
    import argparse
    import json
    from pathlib import Path

    from mm_adaptor.convert.mcore_io import INFO

    info = Path(directory) / INFO
    if info.is_file() and json.loads(info.read_text()).get("lora"):
        saved = argparse.Namespace(**json.loads(info.read_text())["lora"])
    else:
        from mm_adaptor.convert.mcore_io import saved_arguments

        saved = saved_arguments(str(directory))
    if saved is None or not getattr(saved, "lora_target_modules", None):
        raise ValueError(f"{directory}: not a LoRA checkpoint (no adapters' settings in it)")
    towers = ("vision_model",) * bool(getattr(saved, "freeze_vision", False)) + \
        ("language_model",) * bool(getattr(saved, "freeze_language", False))
    return Settings(targets=targets_of(saved.lora_target_modules), r=saved.lora_r, alpha=float(saved.lora_alpha),
                    dropout=getattr(saved, "lora_dropout", 0.0), seed=seed, frozen_towers=towers)


def load_adapters(model, directory) -> int:
    """The adapters of a LoRA checkpoint (its latest iteration) into a model that apply() gave the same
    adapters, resharded to this layout. Returns the tensors loaded."""
    request = sharded_entries(model, checkpoint_metadata(), adapters=True)
    loaded, _ = _load_into(model, request, _stored_checkpoint(directory))
    return len(loaded)
