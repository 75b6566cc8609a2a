"""MindSpeed-MM's commands (mm_adaptor/mindspeed_mm): the table covers every argument of their four Qwen2.5-VL
fine-tuning scripts and nothing else, docs/mindspeed-mm.md's table is the code's, each argument parses and does what
the table says, the 7B model.json gives the 7B model, and data.json's key mapping, pixel bounds and refusals."""

import argparse
import json
import os
from pathlib import Path

import pytest
import qwen_shaped_tokenizer

from mm_adaptor.mindspeed_mm import arguments, data_json, model_json

pytest.importorskip("megatron.training")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The trainer's check of a command (Megatron's parser and validation, their arguments translated): the
    arguments, or the one line and SystemExit(2) the command gives."""
    from mm_adaptor.train import UsageError, _fail, check

    try:
        return check(argv, under_torchrun=False)[0]
    except UsageError as exc:
        _fail(exc.problems)
        raise SystemExit(2) from None

# Facts: the arguments of examples/qwen2.5vl/finetune_qwen2_5_vl_{3b,7b,32b,72b}.sh in Ascend/MindSpeed-MM
# (DISTRIBUTED_ARGS, GPT_ARGS, MM_ARGS, OUTPUT_ARGS and the torchrun line), as (name, value or None for a switch).
DISTRIBUTED = ["--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port"]
COMMON = [
    ("--use-mcore-models", None), ("--tensor-model-parallel-size", "1"), ("--pipeline-model-parallel-size", "1"),
    ("--context-parallel-size", "1"), ("--context-parallel-algo", "ulysses_cp_algo"), ("--micro-batch-size", "1"),
    ("--global-batch-size", "2"), ("--tokenizer-type", "NullTokenizer"), ("--vocab-size", "152064"),
    ("--seq-length", "1024"), ("--make-vocab-size-divisible-by", "1"), ("--normalization", "RMSNorm"),
    ("--use-fused-rmsnorm", None), ("--swiglu", None), ("--use-fused-swiglu", None),
    ("--no-masked-softmax-fusion", None), ("--lr", "1.0e-5"), ("--lr-decay-style", "cosine"),
    ("--weight-decay", "0"), ("--train-iters", "10000"), ("--lr-warmup-fraction", "0.1"), ("--clip-grad", "0.0"),
    ("--adam-beta1", "0.9"), ("--adam-beta2", "0.999"), ("--seed", "42"), ("--bf16", None), ("--load", None),
    ("--use-flash-attn", None), ("--use-distributed-optimizer", None), ("--no-load-optim", None),
    ("--no-load-rng", None), ("--no-save-optim", None), ("--no-save-rng", None), ("--num-workers", "8"),
    ("--distributed-timeout-minutes", "20"), ("--mm-data", None), ("--mm-model", None), ("--mm-tool", "tools.json"),
    ("--log-interval", "1"), ("--save-interval", "10000"), ("--eval-interval", "10000"), ("--eval-iters", "5000"),
    ("--save", None), ("--ckpt-format", "torch"), ("--log-tps", None), ("--distributed-backend", "gloo"),
]
SCRIPTS = {
    "3b": COMMON + [("--no-gradient-accumulation-fusion", None)],
    "7b": COMMON + [("--variable-seq-lengths", None)],
    "32b": COMMON + [("--no-gradient-accumulation-fusion", None), ("--variable-seq-lengths", None)],
    "72b": COMMON + [("--no-gradient-accumulation-fusion", None), ("--variable-seq-lengths", None)],
}
PATHS = {"--load", "--save", "--mm-data", "--mm-model"}  # given by the tests that have the files

# model_7b.json's fields (facts), the towers' sizes of Qwen2.5-VL 7B
MODEL_7B = {
    "model_id": "qwen2_5vl", "img_context_token_id": 151655, "vision_start_token_id": 151652,
    "image_encoder": {
        "vision_encoder": {"model_id": "qwen2vit", "num_layers": 32, "hidden_size": 1280, "ffn_hidden_size": 3420,
                           "llm_hidden_size": 3584, "gated_linear_unit": True, "num_attention_heads": 16,
                           "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                           "layernorm_epsilon": 1e-06, "normalization": "RMSNorm", "bf16": True,
                           "params_dtype": "bf16", "activation_func": "silu", "freeze": True,
                           "post_layer_norm": False, "pipeline_num_layers": [32, 0], "intermediate_size": 3420,
                           "tokens_per_second": 2, "window_attn_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
        "vision_projector": {"model_id": "lnmlp", "num_layers": 1, "gated_linear_unit": False,
                             "add_bias_linear": True, "input_size": 1280, "hidden_size": 3584,
                             "ffn_hidden_size": 5120, "activation_func": "gelu", "bf16": True, "params_dtype": "bf16",
                             "freeze": True, "layernorm_epsilon": 1e-06, "normalization": "RMSNorm"},
    },
    "text_decoder": {"model_id": "qwen2_5_lm", "num_layers": 28, "pipeline_num_layers": [12, 16], "hidden_size": 3584,
                     "ffn_hidden_size": 18944, "num_attention_heads": 28, "seq_length": 1024,
                     "max_position_embeddings": 128000, "vocab_size": 152064, "rope_theta": 1000000.0,
                     "untie_embeddings_and_output_weights": True, "disable_bias_linear": True,
                     "init_method_std": 0.01, "position_embedding_type": "mrope", "normalization": "RMSNorm",
                     "activation_func": "silu", "params_dtype": "bf16", "bf16": True, "group_query_attention": True,
                     "num_query_groups": 4, "mrope_section": [16, 24, 24], "rope_scaling": None,
                     "gated_linear_unit": True, "layernorm_epsilon": 1e-06, "add_bias_linear": False,
                     "add_qkv_bias": True},
    "text_encoder": None, "video_encoder": None,
}


def _argv(pairs, **paths) -> list[str]:
    argv = []
    for name, value in pairs:
        if name in PATHS:
            if name in paths:
                argv += [name, paths[name]]
            continue
        argv += [name] + ([value] if value is not None else [])
    return argv


def test_the_table_has_every_argument_of_the_four_scripts_and_nothing_else():
    scripts = set(DISTRIBUTED) | {name for pairs in SCRIPTS.values() for name, _ in pairs}
    table = [a.name for a in arguments.ARGUMENTS]
    assert len(table) == len(set(table))
    assert set(table) == scripts
    assert {a.kind for a in arguments.ARGUMENTS} <= {arguments.SAME, arguments.MAPPED, arguments.NO_EFFECT,
                                                     arguments.REFUSED, arguments.TORCHRUN}


def test_the_docs_table_is_the_codes(monkeypatch):
    from mm_adaptor.cli import docs_gen

    assert not [p for p in docs_gen.stale() if "mindspeed-mm.md" in p]
    # a table that drifts from the page is reported
    shorter = arguments.ARGUMENTS[:-1]
    monkeypatch.setattr(arguments, "ARGUMENTS", shorter)
    assert any(p.startswith("docs/mindspeed-mm.md differs") for p in docs_gen.stale())


def _single_stage_7b(tmp_path) -> str:
    """model_7b.json on one pipeline stage (the scripts' --pipeline-model-parallel-size 1)."""
    model = json.loads(json.dumps(MODEL_7B))
    model["text_decoder"]["pipeline_num_layers"] = [28]
    model["image_encoder"]["vision_encoder"]["pipeline_num_layers"] = [32]
    path = tmp_path / "model.json"
    path.write_text(json.dumps(model))
    return str(path)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_script_parses_and_says_what_has_no_effect(script, tmp_path, monkeypatch):
    pytest.importorskip("PIL")
    from PIL import Image

    from mm_adaptor.train.arguments import NOTES

    monkeypatch.setenv("MM_ADAPTOR_DEVICE", "cpu")  # what gloo sets, undone after the test
    data = _data(tmp_path)
    Image.new("RGB", (28, 28)).save(tmp_path / "data" / "img" / "a.png")
    qwen_shaped_tokenizer.write(tmp_path / "hf")  # data.json's model_name_or_path: the 7B's vocabulary needs one
    args = parse_args(_argv(SCRIPTS[script], **{"--mm-model": _single_stage_7b(tmp_path), "--mm-data": data}))
    no_effect = [a.name for a in arguments.ARGUMENTS if a.kind == arguments.NO_EFFECT
                 and a.name in {n for n, _ in SCRIPTS[script]}]
    assert sorted(note.split(": ")[0] for note in NOTES if note.startswith("--") and ": no effect" in note
                  and not note.startswith("--mm-data")) == sorted(no_effect), NOTES
    assert (args.lr_warmup_fraction, args.train_iters, args.distributed_timeout_minutes) == (0.1, 10000, 20)
    assert (args.context_parallel_algo, args.use_fused_rmsnorm, args.bf16) == ("ulysses_cp_algo", True, True)
    assert (args.model, args.split) == ("qwen2_5_vl", "100,0,0")


@pytest.mark.parametrize("argv, words", [
    (["--model", "qwen2_5_vl-tiny", "--make-vocab-size-divisible-by", "128"], "pads the vocabulary"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], "one of lr-warmup-fraction and lr-warmup-iters"),
    (["--tokenizer-type", "Qwen2TokenizerFS"], "invalid choice"),
])
def test_refusals_are_one_line_before_anything_starts(argv, words, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and words in err[0], err


def test_a_backend_that_contradicts_the_device_asked_for_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("MM_ADAPTOR_DEVICE", "cpu")
    with pytest.raises(SystemExit):
        parse_args(["--distributed-backend", "nccl"])
    assert "--distributed-backend nccl runs on cuda but MM_ADAPTOR_DEVICE=cpu" in capsys.readouterr().err


def test_hccl_without_torch_npu_is_refused(capsys, monkeypatch):
    monkeypatch.delenv("MM_ADAPTOR_DEVICE", raising=False)
    monkeypatch.setattr(arguments, "has_torch_npu", lambda: False)
    with pytest.raises(SystemExit):
        parse_args(["--distributed-backend", "hccl"])
    assert "--distributed-backend hccl runs on an Ascend NPU, which needs torch_npu" in capsys.readouterr().err


def test_the_7b_model_json_is_the_7b_model():
    """Qwen25VLConfig's defaults are Qwen2.5-VL 7B's (the published config.json)."""
    from mm_adaptor.models.qwen2_5_vl.config import Qwen25VLConfig, config_from_hf

    assert config_from_hf(model_json.hf_config(MODEL_7B)) == Qwen25VLConfig()
    wrong = json.loads(json.dumps(MODEL_7B))
    wrong["image_encoder"]["vision_encoder"]["window_attn_size"] = 224
    assert config_from_hf(model_json.hf_config(wrong)) != Qwen25VLConfig()


def test_fields_without_effect_get_one_line_and_unknown_fields_are_refused():
    model = json.loads(json.dumps(MODEL_7B))
    assert model_json.field_notes(model, "m.json") == []
    model["text_decoder"].update(use_fused_rotary_pos_emb=True, attention_softmax_in_fp32=True)
    notes = model_json.field_notes(model, "m.json")
    assert len(notes) == 1, notes
    assert "text_decoder.use_fused_rotary_pos_emb, text_decoder.attention_softmax_in_fp32: no effect" in notes[0]
    model["image_encoder"]["vision_encoder"]["num_experts"] = 8
    with pytest.raises(model_json.ModelJsonError, match="vision_encoder.num_experts is not read here"):
        model_json.field_notes(model, "m.json")


def _command(tmp_path, *extra, dtype=("--bf16",)) -> argparse.Namespace:
    """A MindSpeed-MM command at PP2 on 2 local ranks, with their data.json."""
    pytest.importorskip("PIL")
    from PIL import Image

    data = _data(tmp_path)
    Image.new("RGB", (28, 28)).save(tmp_path / "data" / "img" / "a.png")
    qwen_shaped_tokenizer.write(tmp_path / "hf")
    return parse_args(["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", *dtype, "--lr", "1e-5",
                       "--micro-batch-size", "1", "--seq-length", "1024",
                       "--mm-data", data, *extra])


def test_the_7b_model_json_sets_the_split_and_the_freezing(tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(MODEL_7B))
    args = _command(tmp_path, "--mm-model", str(path))
    assert (args.model, args.pipeline_layers) == ("qwen2_5_vl", "12,16")
    assert (args.freeze_vision, args.freeze_projector, args.freeze_language) == (True, True, False)
    assert args.init_method_std == 0.01 and args.hf_config["vision_config"]["window_size"] == 112


@pytest.mark.parametrize("change, command, words", [
    (("text_decoder", "pipeline_num_layers", [10, 10, 8]), (), "has 3 stages but --pipeline-model-parallel-size is 2"),
    (("vision_encoder", "pipeline_num_layers", [16, 16]), (), "runs whole on the first stage"),
    (("text_decoder", "normalization", "LayerNorm"), (), "text_decoder.normalization 'LayerNorm'"),
    (("vision_projector", "ffn_hidden_size", 4096), (), "vision_projector.ffn_hidden_size 4096"),
    (("text_decoder", "freeze", True), (), "freezes every module: nothing would train"),
    (None, ("--vocab-size", "151936"), "--vocab-size 151936 but --mm-model"),
    (None, ("--pipeline-layers", "14,14"), "--pipeline-layers 14,14 but --mm-model"),
])
def test_model_json_contradictions_are_refused_naming_both(tmp_path, capsys, change, command, words):
    model = json.loads(json.dumps(MODEL_7B))
    if change:
        module, key, value = change
        section = model["text_decoder"] if module == "text_decoder" else model["image_encoder"][module]
        section[key] = value
    path = tmp_path / "model.json"
    path.write_text(json.dumps(model))
    with pytest.raises(SystemExit):
        _command(tmp_path, "--mm-model", str(path), *command)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_a_dtype_other_than_the_commands_is_refused(tmp_path, capsys):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(MODEL_7B))
    with pytest.raises(SystemExit):
        _command(tmp_path, "--mm-model", str(path), dtype=())
    assert "vision_encoder is bf16 but the command trains in fp32" in capsys.readouterr().err


def _freeze_probe(args):
    import torch

    from mm_adaptor.train.vlm import freeze

    model = torch.nn.Module()
    for tower in ("vision_model", "vision_projection", "language_model"):
        setattr(model, tower, torch.nn.Linear(2, 2))
    return freeze(model, args)["frozen_towers"]


def test_the_projectors_freeze_reaches_the_model():
    base = dict(freeze_vision=True, freeze_language=False)
    assert _freeze_probe(argparse.Namespace(**base, freeze_projector=True)) == ["vision_model", "vision_projection"]
    assert _freeze_probe(argparse.Namespace(**base, freeze_projector=False)) == ["vision_model"]


def _data(tmp_path, **basic):
    (tmp_path / "data" / "img").mkdir(parents=True)
    (tmp_path / "data" / "img" / "a.png").write_bytes(b"")
    records = [{"conv": [{"who": "human", "text": "<image>What?"}, {"who": "gpt", "text": "A cat."}],
                "pics": ["img/a.png"], "sys": "Be brief."}]
    (tmp_path / "data" / "records.json").write_text(json.dumps(records))
    data = {"dataset_param": {
        "preprocess_parameters": {"model_name_or_path": str(tmp_path / "hf"), "image_max_pixels": 262144,
                                  "image_min_pixels": 0},
        "basic_parameters": {"template": "qwen2vl", "dataset_dir": str(tmp_path / "data"),
                             "dataset": "records.json", "cache_dir": "./cache", **basic},
        "attr": {"system": "sys", "images": "pics", "videos": None, "messages": "conv", "role_tag": "who",
                 "content_tag": "text", "user_tag": "human", "assistant_tag": "gpt"}},
        "dataloader_param": {"collate_param": {"ignore_pad_token_for_loss": True}}}
    path = tmp_path / "data.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_data_json_maps_keys_images_pixels_and_tokenizer(tmp_path):
    args = argparse.Namespace(data_path=None, tokenizer_model=None, split=None)
    notes = data_json.apply(args, _data(tmp_path))
    records = json.loads(open(args.data_path[0]).read())
    assert records == [{"messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "<image>What?"},
                                     {"role": "assistant", "content": "A cat."}],
                        "images": [str(tmp_path / "data" / "img" / "a.png")]}]
    assert (args.image_min_pixels, args.image_max_pixels) == (1, 262144)
    assert args.tokenizer_model is None and any("byte tokenizer" in n for n in notes)
    assert any("basic_parameters.cache_dir" in n and "no effect" in n for n in notes)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    args = argparse.Namespace(data_path=None, tokenizer_model=None, split=None)
    data_json.apply(args, _data(tmp_path / "again"))
    assert args.tokenizer_model is None  # the other folder's hf/ has no tokenizer
    args = argparse.Namespace(data_path=None, tokenizer_model=None, split=None)
    path = _data(tmp_path / "third")
    (tmp_path / "third" / "hf").mkdir()
    (tmp_path / "third" / "hf" / "tokenizer.json").write_text("{}")
    data_json.apply(args, path)
    assert args.tokenizer_model == str(tmp_path / "third" / "hf")
    args = argparse.Namespace(data_path=None, tokenizer_model=None, split=None)
    data_json.apply(args, _data(tmp_path / "fourth", max_samples=0))
    assert json.loads(open(args.data_path[0]).read()) == [] and args.split == "100,0,0"


def test_data_json_videos_and_their_settings(tmp_path):
    path = Path(_data(tmp_path))
    data = json.loads(path.read_text())
    data["dataset_param"]["attr"]["videos"] = "clips"
    data["dataset_param"]["preprocess_parameters"].update(video_min_pixels=0, video_max_pixels=65536, video_fps=1.0,
                                                         video_maxlen=32)
    path.write_text(json.dumps(data))
    records = json.loads((tmp_path / "data" / "records.json").read_text())
    records[0]["conv"][0]["text"] = "<video>What?"
    records[0]["clips"], records[0]["pics"] = ["clip.mp4"], []
    (tmp_path / "data" / "records.json").write_text(json.dumps(records))
    args = argparse.Namespace(data_path=None, tokenizer_model=None, split=None)
    notes = data_json.apply(args, str(path))
    written = json.loads(open(args.data_path[0]).read())
    assert written[0]["videos"] == [os.path.abspath("clip.mp4")] and "images" not in written[0]
    assert (args.video_min_pixels, args.video_max_pixels, args.video_fps, args.video_max_frames) == (1, 65536, 1.0, 32)
    assert not any("video_" in note for note in notes)  # taken, not noted as without effect


def test_data_json_with_several_files_blends_them_and_a_later_start_reads_none(tmp_path, monkeypatch):
    path = _data(tmp_path, dataset="records.json, more.json")
    more = [{"conv": [{"who": "human", "text": "Hi"}, {"who": "gpt", "text": "Hello."}]}] * 3
    (tmp_path / "data" / "more.json").write_text(json.dumps(more))
    args = argparse.Namespace(data_path=None, tokenizer_model=None, split=None)
    data_json.apply(args, path)
    assert [len(json.loads(open(p).read())) for p in args.data_path] == [1, 3]  # a blend weighted by sizes
    monkeypatch.setattr(data_json, "_read_dataset", lambda *a: pytest.fail("the dataset was read again"))
    again = argparse.Namespace(data_path=None, tokenizer_model=None, split=None)
    data_json.apply(again, path)
    assert again.data_path == args.data_path
    (tmp_path / "data" / "more.json").write_text(json.dumps(more[:2]))  # a changed file is read again
    with pytest.raises(pytest.fail.Exception, match="read again"):
        data_json.apply(argparse.Namespace(data_path=None, tokenizer_model=None, split=None), path)


@pytest.mark.parametrize("basic, words", [
    ({"dataset": "gone.json"}, "dataset gone.json does not exist"),
    ({"template": "llava"}, "basic_parameters.template 'llava' changes the chat template"),
    ({"train_on_prompt": True}, "changes which tokens the loss counts"),
])
def test_data_json_refusals(tmp_path, basic, words):
    with pytest.raises(data_json.DataJsonError, match=words):
        data_json.apply(argparse.Namespace(data_path=None, tokenizer_model=None, split=None),
                        _data(tmp_path, **basic))
