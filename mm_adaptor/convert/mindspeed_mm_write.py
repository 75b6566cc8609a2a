"""Writing HF Qwen2.5-VL weights in MindSpeed-MM's torch layout (what `mm-convert Qwen2_5_VLConverter hf_to_mm`
writes), for tests and users' fixtures; reading it is mindspeed_mm.py."""

from __future__ import annotations

from pathlib import Path

from mm_adaptor.convert.mindspeed_mm import (CHECKPOINT_VERSION, LAYER, MARKER, OUTPUT_LAYER, PATCH_EMBED, TOWERS,
                                             WEIGHTS, ConvertError, split, theirs)


def write_mm_checkpoint(hf_state_dict: dict, hf_config, out_dir, tp: int, pipeline_num_layers_vit,
                        pipeline_num_layers_llm, iteration="release") -> Path:
    """Writes HF Qwen2.5-VL weights in the layout `mm-convert Qwen2_5_VLConverter hf_to_mm` writes (for tests and
    users' fixtures): `pipeline_num_layers_*` as in their model.json, one count per stage ([32, 0]) or one list per
    virtual chunk ([[16, 0], [16, 0]]). Returns OUT_DIR."""
    import torch

    from mm_adaptor.convert import family_for, hf_to_mcore_tensors
    from mm_adaptor.models.hf_config import tied as is_tied

    vit, llm = (_chunks(counts) for counts in (pipeline_num_layers_vit, pipeline_num_layers_llm))
    pp, vpp = len(llm[0]), len(llm)
    if (len(vit), len(vit[0])) != (vpp, pp):
        raise ConvertError(f"pipeline_num_layers {pipeline_num_layers_vit} and {pipeline_num_layers_llm} name "
                           "different numbers of stages")
    family = family_for(hf_config)
    mcore = hf_to_mcore_tensors(family, hf_state_dict)
    if sum(map(sum, vit)) != family.stacks["vit"] or sum(map(sum, llm)) != family.stacks["llm"]:
        raise ConvertError(f"pipeline_num_layers {pipeline_num_layers_vit} / {pipeline_num_layers_llm} do not add up "
                           f"to the model's {family.stacks['vit']} / {family.stacks['llm']} layers")
    hf_patch = next(t for n, t in hf_state_dict.items() if n.endswith("patch_embed.proj.weight"))
    mcore[PATCH_EMBED] = mcore[PATCH_EMBED].reshape(hf_patch.shape)
    if is_tied(family.config) and pp * vpp > 1:  # their later stages cannot reach the embedding: a copy of it
        mcore[OUTPUT_LAYER] = mcore["language_model.embedding.word_embeddings.weight"]
    flat = {"vit": [n for chunk in vit for n in chunk], "llm": [n for chunk in llm for n in chunk]}
    pieces = [{} for _ in flat["llm"]]
    firsts = {"vit": ("vision_model.patch_embed.",), "llm": ("language_model.embedding.",)}
    lasts = {"vit": ("vision_projection.",), "llm": ("language_model.decoder.final_layernorm.", OUTPUT_LAYER)}
    for tower, counts in flat.items():
        nonzero = [k for k, n in enumerate(counts) if n]
        starts = [sum(counts[:k]) for k in range(len(counts))]
        for name, tensor in mcore.items():
            found = LAYER.match(name)
            if name.startswith(TOWERS[tower]):
                layer = int(found["n"])
                k = max(k for k in nonzero if starts[k] <= layer)
                pieces[k][f"{found['prefix']}{layer - starts[k]}.{found['rest']}"] = tensor
            elif name.startswith(firsts[tower]):
                pieces[nonzero[0]][name] = tensor
            elif name.startswith(lasts[tower]):
                pieces[nonzero[-1]][name] = tensor
    root = Path(out_dir)
    folder = iteration if isinstance(iteration, str) else f"iter_{iteration:07d}"
    for t in range(tp):
        for p in range(pp):
            directory = root / folder / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
            directory.mkdir(parents=True, exist_ok=True)
            models = {}
            for c in range(vpp):
                models["model" if vpp == 1 else f"model{c}"] = {
                    theirs(name): split(name, tensor, tp)[t] for name, tensor in pieces[c * pp + p].items()}
            torch.save({**models, "checkpoint_version": CHECKPOINT_VERSION}, directory / WEIGHTS)
    (root / MARKER).write_text(str(iteration))
    return root


def _chunks(counts) -> list[list[int]]:
    counts = list(counts)
    return [list(c) for c in counts] if counts and isinstance(counts[0], (list, tuple)) else [counts]
