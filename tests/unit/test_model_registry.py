"""The model registry: one spec per family, looked up once, and no per-family branches left in the driver."""

import ast
import json
from pathlib import Path

import pytest

from mm_adaptor.models import registry
from mm_adaptor.harness.runner import LayoutError, check_args, parse_args
from mm_adaptor.train import families

TRAIN = Path(__file__).resolve().parents[2] / "mm_adaptor" / "train"


def test_every_family_is_a_choice_of_model_and_has_driver_hooks():
    assert set(registry.SPECS) == {"gpt", "hybrid", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "internvl"}
    choices = registry.model_choices()
    for spec in registry.SPECS.values():
        assert spec.name in choices and (spec.name + "-tiny" in choices) == spec.has_tiny
        hooks = spec.driver_hooks()
        assert hooks.spec is spec and callable(hooks.forward_step) and callable(hooks.batches)


def test_a_converted_config_names_its_family_by_model_type():
    for model_type, name in (("qwen2_5_vl", "qwen2_5_vl"), ("qwen3_vl", "qwen3_vl"),
                             ("qwen3_vl_moe", "qwen3_vl_moe")):
        assert registry.spec_for_hf_config({"model_type": model_type}).name == name
    with pytest.raises(ValueError, match="'llava' is not a family"):
        registry.spec_for_hf_config({"model_type": "llava"})
    with pytest.raises(ValueError, match="unknown"):
        registry.resolve("gpt-tiny")


def _converted_dir(tmp_path, model_type):
    (tmp_path / "hf").mkdir(parents=True)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": model_type}))
    return tmp_path


def test_the_hf_config_is_read_once_per_process(tmp_path, monkeypatch):
    directory = _converted_dir(tmp_path, "qwen2_5_vl")
    reads = []
    original = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self) or original(self, *a, **k))
    for _ in range(3):
        assert registry.hf_config_of(directory)["model_type"] == "qwen2_5_vl"
    assert reads == [directory / "hf" / "config.json"]


def test_a_converted_load_picks_its_family_without_model(tmp_path):
    directory = _converted_dir(tmp_path, "qwen2_5_vl")
    args = parse_args(["--load", str(directory)])
    assert families.family_name(args) == "qwen2_5_vl" and args.model == "qwen2_5_vl"
    args = parse_args(["--load", str(_converted_dir(tmp_path / "other", "llava"))])
    with pytest.raises(LayoutError, match="'llava' is not a family"):
        check_args(args, 2, check_devices=False)


def test_a_model_that_names_another_family_than_its_load_is_refused(tmp_path):
    directory = _converted_dir(tmp_path, "qwen3_vl")
    args = parse_args(["--model", "qwen2_5_vl", "--load", str(directory), "--data-path", "x.json"])
    with pytest.raises(LayoutError) as error:
        check_args(args, 2, check_devices=False)
    assert error.value.problems == [f"--model qwen2_5_vl: --load {directory} holds a qwen3_vl checkpoint: give "
                                    "--model qwen3_vl (or leave --model out)"]


def test_the_driver_has_no_per_family_branches():
    """Branches on the family live in the hooks (families.py, vlm.py, hybrid.py), not in the loop, the
    checkpoints, the layout rules or the entry points."""
    hooks = {"families.py", "vlm.py", "hybrid.py", "arguments.py"}
    for path in sorted(TRAIN.glob("*.py")):
        if path.name in hooks:
            continue
        source = path.read_text()
        assert "is_vlm" not in source and "is_hybrid" not in source, path.name
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and node.attr in ("model", "hybrid_layer_pattern"):
                assert not (isinstance(node.value, ast.Name) and node.value.id == "args"), (
                    f"{path.name}:{node.lineno} reads args.{node.attr}: ask the family's hooks instead")
