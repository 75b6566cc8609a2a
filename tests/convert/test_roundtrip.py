"""HF -> Megatron dist checkpoint -> HF is exact, at every layout the command takes, and transformers loads it."""

import json

import pytest
import torch


def load_dir(path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def run(argv, capsys) -> str:
    from mm_adaptor.convert.cli import main

    assert main(argv) == 0
    return capsys.readouterr().err


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_round_trip_is_exact(tiny_hf, tmp_path, capsys, tp, pp):
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf, saved = tiny_hf
    layout = ["--llm-pp-layers", "[[1,3]]", "--vit-pp-layers", "[[2,0]]"] if pp == 2 else []
    err = run(["hf-to-mcore", str(hf), str(tmp_path / "mc"), "--tensor-model-parallel-size", str(tp), *layout], capsys)
    n = len(list(hf.glob("*.safetensors")))
    assert f"shard {n}/{n}" in err and "tensors" in err and "GB" in err
    info = json.loads((tmp_path / "mc" / "mm_adaptor_convert.json").read_text())
    assert (info["layout"]["tp"], info["layout"]["pp"]) == (tp, pp)
    assert (tmp_path / "mc" / "hf" / "tokenizer_config.json").exists()
    run(["mcore-to-hf", str(tmp_path / "mc"), str(tmp_path / "back"), "--max-shard-size-gb", "0.0001"], capsys)
    back = load_dir(tmp_path / "back")
    assert sorted(back) == sorted(saved)
    for name, tensor in saved.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == saved.keys()
    assert (tmp_path / "back" / "preprocessor_config.json").exists()
    model, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "back"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert torch.equal(model.lm_head.weight, saved["lm_head.weight"])


def test_tied_bf16_single_file_and_in_memory_names(tmp_path, capsys):
    """A tied config has no output layer; a single model.safetensors with the newer names converts back to the
    names save_pretrained writes, in bf16."""
    from safetensors.torch import save_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tiny import tiny_config

    torch.manual_seed(1)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(tie=True)).to(torch.bfloat16)
    state = {name: t.contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight"}
    assert any(name.startswith("model.language_model.") for name in state)
    (tmp_path / "hf").mkdir()
    save_file(state, str(tmp_path / "hf" / "model.safetensors"))
    model.config.save_pretrained(str(tmp_path / "hf"))
    run(["hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "mc")], capsys)
    run(["mcore-to-hf", str(tmp_path / "mc"), str(tmp_path / "back")], capsys)
    back = load_dir(tmp_path / "back")
    assert "lm_head.weight" not in back and (tmp_path / "back" / "model.safetensors").exists()
    legacy = {name.replace("model.language_model.", "model.").replace("model.visual.", "visual."): t
              for name, t in state.items()}
    assert sorted(back) == sorted(legacy)
    assert all(back[n].dtype == torch.bfloat16 and torch.equal(back[n], t) for n, t in legacy.items())
    loaded, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "back"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert loaded.lm_head.weight.data_ptr() == loaded.model.language_model.embed_tokens.weight.data_ptr()


def test_pure_functions_round_trip(tiny_hf):
    from mm_adaptor.convert import family_for, hf_to_mcore_tensors, mcore_to_hf_tensors
    from tiny import tiny_config

    _, saved = tiny_hf
    family = family_for(tiny_config())
    mcore = hf_to_mcore_tensors(family, saved)
    assert mcore["language_model.decoder.layers.3.self_attention.linear_qkv.weight"].shape == (64 + 2 * 2 * 16, 64)
    back = mcore_to_hf_tensors(family, mcore)
    assert sorted(back) == sorted(saved) and all(torch.equal(back[n], saved[n]) for n in saved)
