"""A Qwen2.5-VL config as transformers 4.57.6 saves it and the same config as 5.24.0 saves it read alike: the same
Qwen25VLConfig (what the driver and `mm-adaptor generate` build) and the same converter Family.

The dicts below are what each version's save_pretrained wrote for Qwen2_5_VLConfig(**tiny_hf_config_dict()) (the
tied variant with tie_word_embeddings=True), trimmed to the keys either reader looks at. What differs: 4.57 repeats
the text values at the top level and spells the rotary settings rope_theta + rope_scaling (its `type` rewritten to
"default"); 5.24 writes one rope_parameters dict (a `type` of "mrope" kept beside rope_type "default"), a vision
rope_parameters, `qwen2_5_vl_vision` as the vision model_type, and the tied flag at the top level only, where 4.57
writes it in text_config."""

import dataclasses

import pytest

TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-06, "max_position_embeddings": 2048,
        "hidden_act": "silu"}
VISION = {"depth": 2, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "hidden_act": "silu",
          "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
          "tokens_per_second": 2, "window_size": 112, "fullatt_block_indexes": [1], "out_hidden_size": 64}
TOKENS = {"image_token_id": 500, "video_token_id": 501, "vision_start_token_id": 502, "vision_end_token_id": 503}


def saved_by_4_57(tie: bool) -> dict:
    rope = {"rope_theta": 10000.0, "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default",
                                                     "type": "default"}}
    config = {"model_type": "qwen2_5_vl", "transformers_version": "4.57.6", **TOKENS, **TEXT, **rope,
              "text_config": {"model_type": "qwen2_5_vl_text", **TEXT, **rope},
              "vision_config": {"model_type": "qwen2_5_vl", **VISION}}
    if tie:
        config["text_config"]["tie_word_embeddings"] = True
    else:
        config["tie_word_embeddings"] = False
    return config


def saved_by_5_24(tie: bool) -> dict:
    return {"model_type": "qwen2_5_vl", "transformers_version": "5.24.0", **TOKENS, "tie_word_embeddings": tie,
            "text_config": {"model_type": "qwen2_5_vl_text", **TEXT, "bos_token_id": 151643, "eos_token_id": 151645,
                            "rope_parameters": {"mrope_section": [2, 3, 3], "rope_theta": 10000.0,
                                                "rope_type": "default", "type": "mrope"}},
            "vision_config": {"model_type": "qwen2_5_vl_vision", **VISION,
                              "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"}}}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_both_versions_spellings_give_the_same_config_and_family(tie):
    from mm_adaptor.convert.families import checkpoint_family, family_for
    from mm_adaptor.models.qwen2_5_vl import config_from_hf, tiny_config

    old, new = saved_by_4_57(tie), saved_by_5_24(tie)
    expected = dataclasses.replace(tiny_config(), tie_word_embeddings=tie)
    assert config_from_hf(old) == expected
    assert config_from_hf(new) == expected

    def fields(family):
        return (family.name, family.rules, family.stacks, family.ignored_hf, family.extra_states,
                family.hf_aliases, family.subsets, family.per_layer_keys)

    assert fields(family_for(old)) == fields(family_for(new))
    assert fields(checkpoint_family(old)) == fields(checkpoint_family(new))
    has_output_layer = any(rule.mcore == "language_model.output_layer.weight" for rule in family_for(new).rules)
    assert has_output_layer == (not tie)


def test_the_saving_version_is_read():
    from mm_adaptor.models.hf_config import rope, saved_by, tied

    assert (saved_by(saved_by_4_57(True)), saved_by(saved_by_5_24(True)), saved_by({})) == (4, 5, None)
    assert rope(saved_by_4_57(False)).spelling == "rope_scaling"
    assert rope(saved_by_5_24(False)).spelling == "rope_parameters"
    # 4.x decides tying by text_config's flag, whatever the top level says; 5.x by the top-level one
    assert tied({**saved_by_4_57(True), "tie_word_embeddings": False})
    assert tied(saved_by_5_24(True)) and not tied(saved_by_5_24(False))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_a_5_24_config_written_back_under_4_57_reads_alike(tmp_path, monkeypatch, tie):
    """mcore-to-hf under transformers 4.x respells a config 5.x saved (4.57 reads rope_parameters as nothing and
    the tied flag from text_config): the same Qwen25VLConfig, and transformers reads mrope and the tying back."""
    import json

    import transformers

    from mm_adaptor.convert import mcore_to_hf
    from mm_adaptor.models.qwen2_5_vl import config_from_hf, tiny_config

    monkeypatch.setattr(mcore_to_hf, "installed_transformers_version", lambda: "4.57.6")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(saved_by_5_24(tie)))
    mcore_to_hf._for_installed(path, None)
    config = json.loads(path.read_text())
    text = config["text_config"]
    assert config["transformers_version"] == "4.57.6" and "rope_parameters" not in text
    assert (text["rope_theta"], text["rope_scaling"]["mrope_section"], text["tie_word_embeddings"]) == \
        (10000.0, [2, 3, 3], tie)
    assert config_from_hf(config) == dataclasses.replace(tiny_config(), tie_word_embeddings=tie)
    read, five = transformers.Qwen2_5_VLConfig.from_dict(config), int(transformers.__version__.split(".")[0]) >= 5
    rope = read.text_config.rope_parameters if five else read.text_config.rope_scaling
    tied = read.tie_word_embeddings if five else read.text_config.tie_word_embeddings
    assert (rope["mrope_section"], tied) == ([2, 3, 3], tie)
