"""Each refusal is one line on stderr, exit status 2, and nothing written."""

import json

import pytest


def write_config(path, **text):
    from tiny import tiny_config

    path.mkdir()
    config = tiny_config(**text)
    (path / "config.json").write_text(config.to_json_string())
    return path


def refuse(argv, capsys, out) -> str:
    from mm_adaptor.convert.cli import main

    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    after = sorted(p.name for p in out.iterdir()) if out.exists() else None
    assert after == before, "the refusal wrote something"
    return lines[0]


@pytest.mark.parametrize("text,tp,words", [
    ({}, 4, "above the llm's 2 key/value heads"),
    ({"num_key_value_heads": 4}, 3, "does not divide the llm's 4 attention heads"),
    ({"num_key_value_heads": 4, "num_attention_heads": 4}, 8, "above the llm's 4 key/value heads"),
])
def test_tensor_parallel_size(tmp_path, capsys, text, tp, words):
    hf = write_config(tmp_path / "hf", **text)
    line = refuse(["hf-to-mcore", str(hf), str(tmp_path / "out"), "--tp", str(tp)], capsys, tmp_path / "out")
    assert words in line


def test_vision_heads_not_divisible(tmp_path, capsys):
    from tiny import tiny_config

    hf = tmp_path / "hf"
    hf.mkdir()
    config = json.loads(tiny_config(num_key_value_heads=4).to_json_string())
    config["vision_config"].update(num_heads=6, hidden_size=36)
    (hf / "config.json").write_text(json.dumps(config))
    line = refuse(["hf-to-mcore", str(hf), str(tmp_path / "out"), "--tp", "4"], capsys, tmp_path / "out")
    assert "does not divide the vit's 6 attention heads" in line


@pytest.mark.parametrize("flags,words", [
    (["--llm-pp-layers", "[[1,2]]"], "--llm-pp-layers [[1, 2]] sums to 3, the model has 4 layers"),
    (["--llm-pp-layers", "2,2", "--vit-pp-layers", "1,2"], "--vit-pp-layers [[1, 2]] sums to 3"),
    (["--llm-pp-layers", "2,2", "--vit-pp-layers", "[[1,1]]"], "puts vision layers on a stage other than the first"),
    (["--llm-pp-layers", "2,2", "--vit-pp-layers", "[[0,2]]"], "puts vision layers on a stage other than the first"),
    (["--llm-pp-layers", "2,2", "--vit-pp-layers", "2,0,0"], "different numbers of pipeline stages"),
    (["--llm-pp-layers", "[[2,x]]"], "expected [[12,16]] or 12,16"),
])
def test_layer_splits(tmp_path, capsys, flags, words):
    hf = write_config(tmp_path / "hf")
    line = refuse(["hf-to-mcore", str(hf), str(tmp_path / "out"), *flags], capsys, tmp_path / "out")
    assert words in line


def _copy(tiny_hf, target):
    import shutil

    shutil.copytree(tiny_hf[0], target)
    return target


def test_unknown_key_is_named(tiny_hf, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    hf = _copy(tiny_hf, tmp_path / "hf")
    shard = sorted(hf.glob("*.safetensors"))[0]
    tensors = load_file(str(shard))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    save_file(tensors, str(shard))
    line = refuse(["hf-to-mcore", str(hf), str(tmp_path / "out")], capsys, tmp_path / "out")
    assert "unknown key model.layers.0.self_attn.rotary_emb.inv_freq" in line


def test_missing_key_is_named(tiny_hf, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    hf = _copy(tiny_hf, tmp_path / "hf")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shard = hf / index["weight_map"]["model.layers.2.mlp.up_proj.weight"]
    tensors = load_file(str(shard))
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, str(shard))
    line = refuse(["hf-to-mcore", str(hf), str(tmp_path / "out")], capsys, tmp_path / "out")
    assert "missing key model.layers.2.mlp.up_proj.weight" in line


def test_output_directory_not_empty(tiny_hf, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = refuse(["hf-to-mcore", str(tiny_hf[0]), str(out)], capsys, out)
    assert f"output directory {out} is not empty" in line
    line = refuse(["mcore-to-hf", str(tmp_path / "nowhere"), str(out)], capsys, out)
    assert "is not empty" in line
    assert (out / "keep.txt").read_text() == "mine"


def test_mcore_to_hf_checks_the_checkpoint_against_the_config(tiny_hf, tmp_path, capsys):
    """A config with more layers than the checkpoint: named, nothing written."""
    from mm_adaptor.convert.cli import main
    from tiny import tiny_config

    assert main(["hf-to-mcore", str(tiny_hf[0]), str(tmp_path / "mc")]) == 0
    capsys.readouterr()
    config = tmp_path / "bigger.json"
    config.write_text(tiny_config(num_hidden_layers=6).to_json_string())
    line = refuse(["mcore-to-hf", str(tmp_path / "mc"), str(tmp_path / "back"), "--hf-config", str(config)], capsys,
                  tmp_path / "back")
    assert "language_model.decoder.layers." in line and ": 4 layers stored, the config says 6" in line


def test_command_line_entry(tmp_path):
    """The installed command: `mm-adaptor convert` refuses in one line with exit 2 (no traceback)."""
    import warm_python

    hf = write_config(tmp_path / "hf")
    result = warm_python.run(["-m", "mm_adaptor.cli", "convert", "hf-to-mcore", str(hf), str(tmp_path / "out"),
                              "--tp", "4"], timeout=120)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "out").exists()


def test_a_conversion_leaves_no_process_behind(tmp_path):
    """megatron's checkpoint writer starts a server process for its results; the converter stops it."""
    import psutil
    import warm_python

    from mm_adaptor.convert.cli import main
    from tiny import save_tiny

    save_tiny(tmp_path / "hf")
    assert main(["hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "mcore")]) == 0
    from mm_adaptor.ranks.launcher import is_process_helper

    left = [p for p in psutil.Process().children(recursive=True)
            if not is_process_helper(p) and p.pid not in warm_python.server_pids()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [" ".join(p.cmdline())[:100] for p in left]


@pytest.mark.parametrize("rope_key", ["rope_scaling", "rope_parameters"])
def test_a_config_the_model_refuses_is_refused_here(tmp_path, capsys, rope_key):
    """What the driver and `mm-adaptor generate` would refuse (here rotary settings without mrope_section, in
    either transformers' spelling) is refused at conversion, in one line, instead of a traceback later."""
    from tiny import tiny_config

    hf = tmp_path / "hf"
    hf.mkdir()
    config = json.loads(tiny_config().to_json_string())
    text = config["text_config"]
    for key in ("rope_scaling", "rope_parameters"):
        text.pop(key, None)
    text[rope_key] = {"rope_type": "default", "rope_theta": 10000.0}
    (hf / "config.json").write_text(json.dumps(config))
    line = refuse(["hf-to-mcore", str(hf), str(tmp_path / "out")], capsys, tmp_path / "out")
    assert line.endswith(f"config.json: the HF config has no {rope_key}.mrope_section; Qwen2.5-VL needs it")
