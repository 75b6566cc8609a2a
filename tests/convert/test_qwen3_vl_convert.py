"""Qwen3-VL and Qwen3-VL-MoE through the converter (mm_adaptor/models/qwen3_vl/mapping.py's rules):

- HF -> Megatron -> HF is exact for tiny dense and MoE models built and saved by the installed transformers, with
  the experts as it saves them (fused), fused in the other major version's layout (told apart by config.json's
  transformers_version), or one tensor set per expert; back in the installed transformers' form, which loads it
  strictly (a config the other major version wrote comes back in the installed one's spelling);
- the converted checkpoint loads into our Qwen3-VL model (TP1 here; TP2 and EP2 over two ranks below), the MoE
  language model's layers keyed one by one as megatron keys a block of mixed dense/MoE layers;
- the real 8B, 30B-A3B and 235B-A22B configs (values from their config.json) map every key with the right shape
  on the meta device;
- refusals: EP that does not divide the experts, fused experts that do not fit the saving version's layout."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))

FORMS = ("as_saved", "other_major", "per_expert")


def _installed_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _hf_classes(moe: bool):
    import transformers

    if moe:
        return transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration
    return transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration


def _load_dir(path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{"dense" | "moe": (directory, tensors)} of seeded tiny models saved by the installed transformers in many
    shards, with tokenizer-like side files."""
    from mm_adaptor.models.qwen3_vl import tiny_config, tiny_hf_config_dict

    out = {}
    for name, moe in (("dense", False), ("moe", True)):
        config_class, model_class = _hf_classes(moe)
        torch.manual_seed(7)
        model = model_class(config_class(**tiny_hf_config_dict(tiny_config(moe=moe))))
        with torch.no_grad():  # norms and biases off their constant initial values
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.1)
        path = tmp_path_factory.mktemp(f"qwen3_vl_{name}")
        model.save_pretrained(str(path), max_shard_size="150KB")
        (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
        out[name] = path, _load_dir(path)
    return out


def _as_form(tensors: dict, form: str) -> dict:
    """The installed transformers' fused experts in another form, by hand: 4.x (E, H, 2I) / (E, I, H), 5.x the
    same transposed, or per expert Linear weights (gate (I, H), up (I, H), down (H, I))."""
    out = {}
    for name, tensor in tensors.items():
        fused = name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        if not fused or form == "as_saved":
            out[name] = tensor
        elif form == "other_major":
            out[name] = tensor.transpose(1, 2).contiguous()
        else:
            linear = tensor if _installed_major() >= 5 else tensor.transpose(1, 2)  # (E, out, in)
            prefix = name.rsplit(".", 1)[0]
            for e, weight in enumerate(linear):
                if name.endswith("gate_up_proj"):
                    gate, up = weight.chunk(2)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                    out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
                else:
                    out[f"{prefix}.{e}.down_proj.weight"] = weight.contiguous()
    return out


def _write_form(source: Path, target: Path, form: str) -> None:
    """A copy of the HF directory with its experts in `form`, shard by shard (the index follows); the other major's
    layout comes with that version in config.json."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    index_path = target / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = {}
    for shard in sorted(target.glob("*.safetensors")):
        tensors = _as_form(load_file(str(shard)), form)
        save_file(tensors, str(shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard.name))
    index["weight_map"] = weight_map
    index_path.write_text(json.dumps(index))
    if form == "other_major":
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps(_respelled(config, 4 if _installed_major() >= 5 else 5)))


def _respelled(config: dict, major: int) -> dict:
    """The config as the other major version writes it (as 4.57.6 and 5.24.0 were seen to): 5.x keeps rope_theta
    in rope_parameters, counts experts in num_local_experts and gives the vision config an axial rope; 4.x the
    reverse, the tied flag in text_config."""
    config, text = dict(config), dict(config["text_config"])
    vision = dict(config["vision_config"])
    if major >= 5:
        text["rope_parameters"] = {**text.pop("rope_scaling"), "rope_theta": text.pop("rope_theta")}
        text["num_local_experts"] = text.pop("num_experts")
        vision["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "axial"}
    else:
        scaling = dict(text.pop("rope_parameters"))
        text["rope_theta"] = scaling.pop("rope_theta")
        text["rope_scaling"] = scaling
        text["num_experts"] = text.pop("num_local_experts")
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
        vision.pop("rope_parameters", None)
    config.update(text_config=text, vision_config=vision, transformers_version="5.24.0" if major >= 5 else "4.57.6")
    return config


def _run(argv, capsys) -> str:
    from mm_adaptor.convert.cli import main

    assert main(argv) == 0
    return capsys.readouterr().err


ROUND_TRIPS = {  # name: (model, expert form, layout flags, (TP, EP))
    "dense_tp2": ("dense", "as_saved", ["--tensor-model-parallel-size", "2"], (2, 1)),
    "moe_fused_ep2": ("moe", "as_saved", ["--expert-model-parallel-size", "2"], (1, 2)),
    "moe_other_major_fused_tp2": ("moe", "other_major", ["--tensor-model-parallel-size", "2"], (2, 1)),
    "moe_per_expert_tp2_ep2": ("moe", "per_expert", ["--tp", "2", "--ep", "2"], (2, 2)),
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_round_trip_is_exact_and_loads_strictly(saved, tmp_path, capsys, case):
    model, form, layout, (tp, ep) = ROUND_TRIPS[case]
    path, tensors = saved[model]
    _write_form(path, tmp_path / "hf", form)
    written = _load_dir(tmp_path / "hf")
    if form == "per_expert":
        assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in written
    if form == "other_major":
        gate_up = "model.language_model.layers.0.mlp.experts.gate_up_proj"
        assert written[gate_up].shape == tensors[gate_up].transpose(1, 2).shape != tensors[gate_up].shape
    _run(["hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "mc"), *layout], capsys)
    recorded = json.loads((tmp_path / "mc" / "mm_adaptor_convert.json").read_text())["layout"]
    assert (recorded["tp"], recorded["ep"]) == (tp, ep)
    _run(["mcore-to-hf", str(tmp_path / "mc"), str(tmp_path / "back"), "--max-shard-size-gb", "0.0002"], capsys)
    back = _load_dir(tmp_path / "back")
    assert sorted(back) == sorted(tensors)  # the installed transformers' own form, whatever came in
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert int(config["transformers_version"].split(".")[0]) == _installed_major()
    if form == "other_major" and _installed_major() < 5:  # a 5.x config, spelled for 4.x on the way back
        assert (config["text_config"]["num_experts"], config["text_config"]["rope_scaling"]["mrope_section"]) == \
            (4, [6, 5, 5])
    assert (tmp_path / "back" / "tokenizer_config.json").exists()
    _, model_class = _hf_classes(model == "moe")
    loaded, info = model_class.from_pretrained(str(tmp_path / "back"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in tensors.items())


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_checkpoint_loads_into_our_qwen3_vl_model(saved, tmp_path, single_rank_megatron, model):
    """megatron's dist_checkpointing.load fills every tensor and _extra_state our model asks for (the MoE language
    model keyed layer by layer, its experts under their global numbers) with the rules' tensors."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mm_adaptor.convert import hf_to_mcore_tensors
    from mm_adaptor.convert.families import checkpoint_family
    from mm_adaptor.convert.hf_to_mcore import convert
    from mm_adaptor.models.qwen3_vl import config_from_hf, model_provider

    path, tensors = saved[model]
    convert(path, tmp_path / "mc")
    hf_config = json.loads((path / "config.json").read_text())
    family = checkpoint_family(hf_config)
    assert family.per_layer_keys == (("language_model.decoder.layers.",) if model == "moe" else ())
    model_parallel_cuda_manual_seed(5)
    ours = model_provider(config_from_hf(hf_config))
    request = ours.sharded_state_dict(prefix="", metadata={"singleton_local_shards": False})
    loaded = dist_checkpointing.load({"model": request}, str(tmp_path / "mc" / "iter_0000000"))["model"]
    result = ours.load_state_dict(loaded, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    expected = hf_to_mcore_tensors(family, tensors)
    state = {name: t for name, t in ours.state_dict().items() if not name.endswith("_extra_state")}
    assert sorted(state) == sorted(expected)
    for name, tensor in state.items():
        assert torch.equal(tensor, expected[name]), name


PARALLEL = {"moe_ep2": ("moe", dict(expert_model_parallel_size=2)),
            "moe_tp2": ("moe", dict(tensor_model_parallel_size=2)),
            "dense_tp2": ("dense", dict(tensor_model_parallel_size=2))}


def _rank_main(workdir):
    from megatron.core import dist_checkpointing

    from gloo_rank import model_parallel, a_rank
    from mm_adaptor.models.qwen3_vl import config_from_hf, model_provider
    from qwen3_reference import local_shard

    with a_rank(workdir) as (case, results):
        for layout, (model, fields) in PARALLEL.items():
            config = config_from_hf(case["config", model], **fields)
            with model_parallel(config.tensor_model_parallel_size,
                                expert_model_parallel_size=config.expert_model_parallel_size):
                ours = model_provider(config)
                request = ours.sharded_state_dict(prefix="", metadata={"singleton_local_shards": False})
                loaded = dist_checkpointing.load({"model": request}, os.path.join(workdir, model, "iter_0000000"))
                ours.load_state_dict(loaded["model"], strict=True)
                own = {k: v for k, v in ours.state_dict().items() if not k.endswith("_extra_state")}
                shard = local_shard(ours, case["whole", model])
                experts = getattr(ours.language_model.decoder.layers[0].mlp, "experts", None)
                results[layout] = {"keys": sorted(own), "expected_keys": sorted(shard),
                                   "differ": [k for k in own if k in shard and not torch.equal(own[k], shard[k])],
                                   "local_experts": len(experts.local_experts) if experts is not None else 0}


@pytest.fixture(scope="module")
def parallel_runs(saved, tmp_path_factory):
    from mm_adaptor.convert import hf_to_mcore_tensors
    from mm_adaptor.convert.families import family_for
    from gloo_rank import run_ranks
    from mm_adaptor.convert.hf_to_mcore import convert

    workdir = tmp_path_factory.mktemp("qwen3_vl_parallel_load")
    case = {}
    for model, (path, tensors) in saved.items():
        convert(path, workdir / model, tp=2, ep=2 if model == "moe" else 1)
        case["config", model] = json.loads((path / "config.json").read_text())
        case["whole", model] = hf_to_mcore_tensors(family_for(case["config", model]), tensors)
    return run_ranks(_rank_main, workdir, case)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", PARALLEL)
def test_resharded_load_equals_the_reference_shards(parallel_runs, layout):
    """Over two gloo ranks megatron reshards the converted checkpoint: each rank's tensors equal the cut
    tests/models/qwen3_reference.local_shard makes from the whole tensors; at EP2 each rank holds its two experts
    (global 0-1 and 2-3) as local 0-1."""
    for rank in parallel_runs:
        result = rank[layout]
        assert result["keys"] == result["expected_keys"]
        assert result["differ"] == []
        assert result["local_experts"] == {"moe_ep2": 2, "moe_tp2": 4, "dense_tp2": 0}[layout]


def test_expert_parallel_size_must_divide_the_experts(saved, tmp_path, capsys):
    from test_refusals import refuse

    path = saved["moe"][0]
    line = refuse(["hf-to-mcore", str(path), str(tmp_path / "out"), "--ep", "3"], capsys, tmp_path / "out")
    assert line.endswith("--expert-model-parallel-size 3 does not divide the model's 4 experts")
    line = refuse(["hf-to-mcore", str(saved["dense"][0]), str(tmp_path / "out"), "--ep", "2"], capsys,
                  tmp_path / "out")
    assert line.endswith("--expert-model-parallel-size 2: the model has no experts")


def test_fused_experts_that_do_not_fit_the_saving_version_are_refused(saved, tmp_path, capsys):
    """Experts in one major version's layout under a config.json that names the other: refused in one line (the
    shapes are checked against the version, never used to pick it)."""
    from test_refusals import refuse

    source = tmp_path / "source"
    _write_form(saved["moe"][0], source, "as_saved")
    config = json.loads((source / "config.json").read_text())
    config["transformers_version"] = "4.57.6" if _installed_major() >= 5 else "5.24.0"
    (source / "config.json").write_text(json.dumps(config))
    line = refuse(["hf-to-mcore", str(source), str(tmp_path / "out")], capsys, tmp_path / "out")
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in line
    assert line.endswith(f"config.json's transformers_version {config['transformers_version']} says")


# ---- the released configs on the meta device ----

VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
          "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
          "deepstack_visual_indexes": [8, 16, 24], "hidden_act": "gelu_pytorch_tanh"}
TEXT = {"vocab_size": 151936, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 5000000,
        "max_position_embeddings": 262144, "attention_bias": False,
        "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}}
MOE = {"num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
       "norm_topk_prob": True}
REAL = {  # name: (model_type, text values, layout (tp, ep, llm split))
    "8B": ("qwen3_vl", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                            num_key_value_heads=8), (4, 1, [18, 18])),
    "30B-A3B": ("qwen3_vl_moe", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                     num_attention_heads=32, num_key_value_heads=4, moe_intermediate_size=768, **MOE),
                (4, 8, [24, 24])),
    "235B-A22B": ("qwen3_vl_moe", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                                       num_attention_heads=64, num_key_value_heads=4, moe_intermediate_size=1536,
                                       **MOE), (4, 16, [46, 48])),
}


def hub_config(size: str) -> dict:
    """config.json as released, less its transformers_version: the meta model's state dict is in the installed
    transformers' layout, which is what the converter takes for a config that names no version."""
    model_type, text, _ = REAL[size]
    architecture = "Qwen3VLMoeForConditionalGeneration" if model_type == "qwen3_vl_moe" else \
        "Qwen3VLForConditionalGeneration"
    return {"model_type": model_type, "architectures": [architecture], "tie_word_embeddings": False,
            "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "text_config": {**TEXT, **text, "model_type": model_type + "_text"},
            "vision_config": {**VISION, "out_hidden_size": text["hidden_size"], "model_type": model_type}}


def megatron_shapes(text: dict) -> dict:
    """Every Megatron tensor's shape under these sizes (the vision tower, the merger and the three DeepStack
    mergers, the language model with q/k norms, dense MLPs or a router and experts)."""
    vh, vffn, h = VISION["hidden_size"], VISION["intermediate_size"], text["hidden_size"]
    merged, hd = vh * VISION["spatial_merge_size"] ** 2, TEXT["head_dim"]
    heads, kv = text["num_attention_heads"], text["num_key_value_heads"]
    shapes = {"vision_model.patch_embed.proj.weight": (vh, 3 * 2 * 16 * 16),
              "vision_model.patch_embed.proj.bias": (vh,),
              "vision_model.pos_embed.weight": (VISION["num_position_embeddings"], vh),
              "vision_projection.layernorm.weight": (vh,), "vision_projection.layernorm.bias": (vh,),
              "language_model.embedding.word_embeddings.weight": (151936, h),
              "language_model.decoder.final_layernorm.weight": (h,), "language_model.output_layer.weight": (151936, h)}
    for merger in ["vision_projection."] + [f"deepstack_projections.{k}." for k in range(3)]:
        shapes.update({merger + "encoder.linear_fc1.weight": (merged, merged),
                       merger + "encoder.linear_fc1.bias": (merged,),
                       merger + "encoder.linear_fc2.weight": (h, merged), merger + "encoder.linear_fc2.bias": (h,)})
        if merger != "vision_projection.":  # the DeepStack mergers normalise the merged patches
            shapes.update({merger + "layernorm.weight": (merged,), merger + "layernorm.bias": (merged,)})
    for i in range(VISION["depth"]):
        p = f"vision_model.decoder.layers.{i}."
        for suffix in ("weight", "bias"):
            shapes.update({p + f"input_layernorm.{suffix}": (vh,), p + f"pre_mlp_layernorm.{suffix}": (vh,)})
        shapes.update({p + "self_attention.linear_qkv.weight": (3 * vh, vh),
                       p + "self_attention.linear_qkv.bias": (3 * vh,),
                       p + "self_attention.linear_proj.weight": (vh, vh), p + "self_attention.linear_proj.bias": (vh,),
                       p + "mlp.linear_fc1.weight": (vffn, vh), p + "mlp.linear_fc1.bias": (vffn,),
                       p + "mlp.linear_fc2.weight": (vh, vffn), p + "mlp.linear_fc2.bias": (vh,)})
    for i in range(text["num_hidden_layers"]):
        p = f"language_model.decoder.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "pre_mlp_layernorm.weight": (h,),
                       p + "self_attention.linear_qkv.weight": ((heads + 2 * kv) * hd, h),
                       p + "self_attention.q_layernorm.weight": (hd,), p + "self_attention.k_layernorm.weight": (hd,),
                       p + "self_attention.linear_proj.weight": (h, heads * hd)})
        if "num_experts" not in text:
            ffn = text["intermediate_size"]
            shapes.update({p + "mlp.linear_fc1.weight": (2 * ffn, h), p + "mlp.linear_fc2.weight": (h, ffn)})
            continue
        inner = text["moe_intermediate_size"]
        shapes[p + "mlp.router.weight"] = (text["num_experts"], h)
        for e in range(text["num_experts"]):
            shapes.update({p + f"mlp.experts.local_experts.{e}.linear_fc1.weight": (2 * inner, h),
                           p + f"mlp.experts.local_experts.{e}.linear_fc2.weight": (h, inner)})
    return shapes


@pytest.mark.parametrize("size", list(REAL))
def test_real_config_maps_every_key(size):
    from mm_adaptor.convert import ConvertError, hf_to_mcore_tensors, installed_transformers_major, mcore_to_hf_tensors
    from mm_adaptor.convert.families import checkpoint_family, dims_for
    from mm_adaptor.convert.layout import validate

    model_type, text, (tp, ep, split) = REAL[size]
    config = hub_config(size)
    config_class, model_class = _hf_classes(model_type == "qwen3_vl_moe")
    with torch.device("meta"):
        model = model_class(config_class.from_dict(config))
    hf = dict(model.state_dict())
    family = checkpoint_family(config)
    mcore = hf_to_mcore_tensors(family, hf)
    assert {name: tuple(t.shape) for name, t in mcore.items()} == megatron_shapes(text)
    back = mcore_to_hf_tensors(family, mcore, fused_major=installed_transformers_major())
    assert {name: tuple(t.shape) for name, t in back.items()} == {name: tuple(t.shape) for name, t in hf.items()}
    experts = text.get("num_experts", 0)
    assert family.num_experts == experts
    assert family.per_layer_keys == (("language_model.decoder.layers.",) if experts else ())
    layout = validate(dims_for(config), tp, [split], [[27, 0]], ep, family.num_experts)
    assert (layout.tp, layout.ep, layout.pp) == (tp, ep, 2)
    if experts:
        with pytest.raises(ConvertError, match=f"does not divide the model's {experts} experts"):
            validate(dims_for(config), tp, [split], [[27, 0]], 3, family.num_experts)
        keys = family.checkpoint_keys()
        assert keys["language_model.decoder.layers.5.mlp.experts.experts.linear_fc1.weight"] == (experts,)
        assert keys["vision_model.decoder.layers.self_attention.linear_qkv.weight"] == (27,)
