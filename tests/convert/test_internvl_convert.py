"""InternVL through the converter (mm_adaptor/models/internvl/mapping.py's rules), both checkpoint layouts:

- native: a tiny model of each InternViT variant saved by the installed transformers (4.57 writes
  `language_model.model.*` / `vision_tower.*`, 5.x `model.language_model.*`), HF -> Megatron (TP2) -> HF is
  torch.equal on every tensor, written under the in-memory names, which transformers loads strictly;
- original (OpenGVLab `InternVLChatModel` names, fused vision qkv, ls1/ls2, mlp1): HF -> Megatron -> HF with
  `--layout original` gives back the same names and tensors and an internvl_chat config; without it, the native
  layout, which transformers loads strictly with the same weights;
- refusals (one line, exit 2, nothing written): TP above the key/value heads, an unknown key, a missing key, the
  v1 pixel shuffle, --layout for a family with one layout."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))

from test_qwen3_vl_convert import _load_dir  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{(variant, layout): (directory, tensors)}: seeded tiny models saved by the installed transformers (native),
    and the 300M-class one renamed to the OpenGVLab layout with its config."""
    from internvl_reference import VARIANTS, hf_model, original_state
    from safetensors.torch import save_file

    from mm_adaptor.models.internvl import original_config_dict

    out = {}
    for variant, config in VARIANTS.items():
        model = hf_model(config, seed=7)
        path = tmp_path_factory.mktemp(f"internvl_{variant}")
        model.save_pretrained(str(path), max_shard_size="100KB")
        (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
        out[variant, "native"] = path, _load_dir(path)
        if variant == "300m":
            original = tmp_path_factory.mktemp("internvl_original")
            tensors = original_state(model.state_dict(), config)
            save_file(tensors, str(original / "model.safetensors"), metadata={"format": "pt"})
            (original / "config.json").write_text(json.dumps(original_config_dict(config)))
            out[variant, "original"] = original, tensors
    return out


def _run(argv, capsys) -> str:
    from mm_adaptor.convert.cli import main

    assert main(argv) == 0
    return capsys.readouterr().err


def _in_memory_names(tensors: dict) -> dict:
    """Saved names -> the names transformers' model holds the tensors under."""
    from mm_adaptor.models.internvl.mapping import NATIVE_ALIASES

    out = {}
    for name, tensor in tensors.items():
        for in_memory, saved_prefix in NATIVE_ALIASES.items():
            if name.startswith(saved_prefix):
                name = in_memory + name[len(saved_prefix):]
                break
        out[name] = tensor
    return out


def _loads_strictly(path, expected: dict):
    import transformers

    loaded, info = transformers.InternVLForConditionalGeneration.from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = loaded.state_dict()
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("variant", ["300m", "6b"])
def test_native_round_trip_is_exact_and_loads_strictly(saved, tmp_path, capsys, variant):
    path, tensors = saved[variant, "native"]
    _run(["hf-to-mcore", str(path), str(tmp_path / "mc"), "--tp", "2", "--llm-pp-layers", "3,1",
          "--vit-pp-layers", "2,0"], capsys)
    _run(["mcore-to-hf", str(tmp_path / "mc"), str(tmp_path / "back"), "--max-shard-size-gb", "0.0002"], capsys)
    back = _load_dir(tmp_path / "back")
    assert sorted(back) == sorted(tensors)  # the names transformers' save_pretrained wrote
    assert "language_model.lm_head.weight" in back and any(name.startswith("vision_tower.") for name in back)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert (tmp_path / "back" / "tokenizer_config.json").exists()
    _loads_strictly(tmp_path / "back", _in_memory_names(tensors))


def test_original_layout_round_trip_and_native_output(saved, tmp_path, capsys):
    path, tensors = saved["300m", "original"]
    assert "vision_model.encoder.layers.0.attn.qkv.weight" in tensors and "mlp1.1.weight" in tensors
    _run(["hf-to-mcore", str(path), str(tmp_path / "mc")], capsys)
    _run(["mcore-to-hf", str(tmp_path / "mc"), str(tmp_path / "orig"), "--layout", "original"], capsys)
    back = _load_dir(tmp_path / "orig")
    assert sorted(back) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor), name
    config = json.loads((tmp_path / "orig" / "config.json").read_text())
    assert config["model_type"] == "internvl_chat" and config["select_layer"] == -1
    _run(["mcore-to-hf", str(tmp_path / "mc"), str(tmp_path / "native")], capsys)
    assert json.loads((tmp_path / "native" / "config.json").read_text())["model_type"] == "internvl"
    _loads_strictly(tmp_path / "native", _in_memory_names(saved["300m", "native"][1]))


def test_refusals(saved, tmp_path, capsys):
    from safetensors.torch import save_file
    from test_refusals import refuse

    path, tensors = saved["300m", "original"]
    line = refuse(["hf-to-mcore", str(path), str(tmp_path / "out"), "--tp", "8"], capsys, tmp_path / "out")
    assert line.endswith("--tensor-model-parallel-size 8 is above the llm's 2 key/value heads")

    broken = tmp_path / "unknown"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    save_file({**tensors, "vision_model.encoder.layers.0.attn.extra": torch.zeros(1)},
              str(broken / "model.safetensors"))
    line = refuse(["hf-to-mcore", str(broken), str(tmp_path / "out")], capsys, tmp_path / "out")
    assert "vision_model.encoder.layers.0.attn.extra" in line

    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != "mlp1.3.bias"}, str(missing / "model.safetensors"))
    line = refuse(["hf-to-mcore", str(missing), str(tmp_path / "out")], capsys, tmp_path / "out")
    assert "mlp1.3.bias" in line

    config = json.loads((path / "config.json").read_text())
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "config.json").write_text(json.dumps({**config, "ps_version": "v1"}))
    save_file(tensors, str(tmp_path / "v1" / "model.safetensors"))
    line = refuse(["hf-to-mcore", str(tmp_path / "v1"), str(tmp_path / "out")], capsys, tmp_path / "out")
    assert "ps_version 'v1'" in line

    from mm_adaptor.models.qwen2_5_vl import tiny_hf_config_dict

    (tmp_path / "qwen" / "hf").mkdir(parents=True)
    (tmp_path / "qwen" / "hf" / "config.json").write_text(json.dumps(tiny_hf_config_dict()))
    line = refuse(["mcore-to-hf", str(tmp_path / "qwen"), str(tmp_path / "out"), "--layout", "original"], capsys,
                  tmp_path / "out")
    assert line.endswith("--layout original: qwen2_5_vl checkpoints have one layout")


# ---- released configs on the meta device (values from their config.json, OpenGVLab layout) ----
# Where each value comes from (checked 2026-11-27; no hub access here, so printouts and copies of the configs):
# - InternVL3-1B: the remote-code model's printed config and module tree (public notes "InternVL3-1B_data.md" in
#   github.com/shivangjhalani/multicoco): llm_config Qwen2 896 / 4864 / 24 layers / 14 heads / 2 KV heads, vocab
#   151674 (lm_head Linear(896, 151674), a separate module), rms_norm_eps 1e-6, rope_theta 1e6, max positions
#   32768; top-level "tie_word_embeddings": false (so untied, as written below); vision 300M class 1024 / 4096 /
#   16 heads / 24 layers, qkv_bias true, qk_normalization false, layer_norm, eps 1e-6, 448 px, patch 14;
#   downsample 0.5, ps_version v2, select_layer -1, template internvl2_5; mlp1.0 LayerNorm eps 1e-5. Its
#   tokenizer holds <img> 151665, </img> 151666, <IMG_CONTEXT> 151667 (transformers' conversion script gives
#   Qwen2 models image_token_id 151667 too). Its llm_config also has rope_scaling {"rope_type": "dynamic",
#   "factor": 2.0} (kept below: plain RoPE up to max_position_embeddings, test_internvl_config).
# - InternVL3-8B: Qwen2.5-7B's config (3584 / 18944 / 28 layers / 28 heads / 4 KV heads, untied), InternVL3's
#   resized vocabulary 151674 (the same tokenizer as the 1B), InternViT-300M as above.
# - InternVL2.5-78B: InternViT-6B-448px-V2_5 + Qwen2.5-72B-Instruct (model card); Qwen2.5-72B 8192 / 29568 / 80 /
#   64 heads / 8 KV heads, untied; InternViT-6B 3200 / 12800 / 25 heads / 45 layers, rms_norm, qk_normalization
#   true, qkv_bias false (copies of its vision_config in public code; Megatron-LM's NVLM example uses the same
#   tower); vocabulary 151674 as above (not seen in a copy of the 78B's own config).

VIT_300M = {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
            "qkv_bias": True, "qk_normalization": False, "norm_type": "layer_norm"}
VIT_6B = {"hidden_size": 3200, "intermediate_size": 12800, "num_attention_heads": 25, "num_hidden_layers": 45,
          "qkv_bias": False, "qk_normalization": True, "norm_type": "rms_norm"}
REAL = {  # name: (vision, Qwen2.5 LLM values, layout that fits (tp, llm split, vit split))
    "InternVL3-1B": (VIT_300M, dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                    num_attention_heads=14, num_key_value_heads=2,
                                    rope_scaling={"factor": 2.0, "rope_type": "dynamic", "type": "dynamic"}),
                     (2, [12, 12], [24, 0])),
    "InternVL3-8B": (VIT_300M, dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                    num_attention_heads=28, num_key_value_heads=4), (4, [12, 16], [24, 0])),
    "InternVL2.5-78B": (VIT_6B, dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                                     num_attention_heads=64, num_key_value_heads=8), (1, [18, 20, 21, 21],
                                                                                      [45, 0, 0, 0])),
}


def original_hub_config(name: str) -> dict:
    vision, text, _ = REAL[name]
    return {"model_type": "internvl_chat", "architectures": ["InternVLChatModel"], "downsample_ratio": 0.5,
            "select_layer": -1, "ps_version": "v2", "force_image_size": 448, "template": "internvl2_5",
            "vision_config": {**vision, "model_type": "intern_vit_6b", "image_size": 448, "patch_size": 14,
                              "layer_norm_eps": 1e-6, "hidden_act": "gelu", "num_channels": 3},
            "llm_config": {**text, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151674,
                           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
                           "tie_word_embeddings": False}}


@pytest.mark.parametrize("name", list(REAL))
def test_real_config_maps_every_key(name):
    """The native model transformers builds from the config (meta device) maps to Megatron and back with every key
    and shape, and so does the OpenGVLab layout; the layout that fits is accepted, TP 8 refused where the vision
    tower's heads (25 for InternViT-6B) or the language model's key/value heads do not allow it."""
    import transformers

    from mm_adaptor.convert import ConvertError, hf_to_mcore_tensors, mcore_to_hf_tensors
    from mm_adaptor.convert.families import checkpoint_family, dims_for
    from mm_adaptor.convert.layout import validate
    from mm_adaptor.models.internvl import config_from_hf
    from mm_adaptor.models.internvl.mapping import family as internvl_family

    vision, text, (tp, llm, vit) = REAL[name]
    original = original_hub_config(name)
    native = checkpoint_family(original, "native", writing=True).config
    dynamic = (text.get("rope_scaling") or {}).get("factor")
    assert config_from_hf(original).rope_dynamic_factor == config_from_hf(native).rope_dynamic_factor == dynamic
    with torch.device("meta"):
        model = transformers.InternVLForConditionalGeneration(transformers.InternVLConfig(**native))
    hf = {k: v for k, v in model.state_dict().items()}
    mcore = hf_to_mcore_tensors(checkpoint_family(native), hf)
    h, vh, heads, kv = text["hidden_size"], vision["hidden_size"], text["num_attention_heads"], \
        text["num_key_value_heads"]
    head_dim = h // heads
    assert tuple(mcore["language_model.decoder.layers.0.self_attention.linear_qkv.weight"].shape) == \
        ((heads + 2 * kv) * head_dim, h)
    assert tuple(mcore["vision_model.decoder.layers.0.self_attention.linear_qkv.weight"].shape) == (3 * vh, vh)
    assert tuple(mcore["vision_model.position_embeddings"].shape) == (1, 32 * 32 + 1, vh)
    assert tuple(mcore["vision_projection.encoder.linear_fc1.weight"].shape) == (h, 4 * vh)
    assert ("vision_model.decoder.layers.0.self_attention.q_layernorm.weight" in mcore) == vision["qk_normalization"]
    assert ("vision_model.decoder.layers.0.self_attention.linear_qkv.bias" in mcore) == vision["qkv_bias"]
    back = _in_memory_names(mcore_to_hf_tensors(checkpoint_family(native), mcore))
    assert {k: tuple(v.shape) for k, v in back.items()} == {k: tuple(v.shape) for k, v in hf.items()}
    as_original = mcore_to_hf_tensors(internvl_family(original), mcore)
    assert len(as_original) == len(hf) - (3 * 2 - 2) * vision["num_hidden_layers"] // (1 if vision["qkv_bias"] else 2)
    assert {k: tuple(v.shape) for k, v in hf_to_mcore_tensors(internvl_family(original), as_original).items()} == \
        {k: tuple(v.shape) for k, v in mcore.items()}
    layout = validate(dims_for(original), tp, [llm], [vit])
    assert (layout.tp, layout.pp) == (tp, len(llm))
    with pytest.raises(ConvertError, match="--tensor-model-parallel-size 8"):
        validate(dims_for(original), 8, [llm], [vit])
