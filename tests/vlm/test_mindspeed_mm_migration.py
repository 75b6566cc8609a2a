"""Issue 42's migration test: MindSpeed-MM's Qwen2.5-VL 7B fine-tuning command, with only sizes and paths changed
and `pretrain_vlm.py ... nccl` replaced by `-m mm_adaptor.train ... gloo`, runs on 2 CPU ranks under torchrun from
a tiny model.json and data.json in their schema (written here) and a checkpoint of a seeded tiny transformers
Qwen2.5-VL, at TP1 PP2 with the vision encoder frozen by the model.json, on Megatron-LM's training loop: the loss
falls by at least 20% in 20 iterations on the shapes captions (they depend on the picture), --log-tps prints tokens
per sample, the vision encoder's weights are saved unchanged (their --ckpt-format torch save, converted to
torch_dist by Megatron's own converter, then to HF). The refusals: a math-changing argument, a model.json that
contradicts the checkpoint, a data.json whose dataset file is missing (one line, status 2, before any rank
starts)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mm_adaptor.ranks.launcher import free_port

pytestmark = pytest.mark.distributed

ITERATIONS = 20
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|.*?tokens per sample: ([0-9.]+) \|")


def their_model_json(pipeline_text=(2, 2), freeze_vision=True, **text) -> dict:
    """model_7b.json's schema with the tiny preset's sizes (mm_adaptor.models.qwen2_5_vl.tiny_config)."""
    return {
        "model_id": "qwen2_5vl", "img_context_token_id": 500, "vision_start_token_id": 502,
        "image_encoder": {
            "vision_encoder": {
                "model_id": "qwen2vit", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96,
                "llm_hidden_size": 64, "gated_linear_unit": True, "bias_activation_fusion": True,
                "num_attention_heads": 4, "hidden_dropout": 0.0, "attention_dropout": 0.0, "in_channels": 3,
                "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "layernorm_epsilon": 1e-06,
                "normalization": "RMSNorm", "fp16": False, "bf16": True, "params_dtype": "bf16",
                "activation_func": "silu", "freeze": freeze_vision, "use_fused_rotary_pos_emb": True,
                "post_layer_norm": False, "pipeline_num_layers": [2, 0], "intermediate_size": 96,
                "tokens_per_second": 2, "window_attn_size": 112, "fullatt_block_indexes": [1],
                "attention_mask_type": "general"},
            "vision_projector": {
                "model_id": "lnmlp", "num_layers": 1, "gated_linear_unit": False, "bias_activation_fusion": False,
                "add_bias_linear": True, "input_size": 64, "hidden_size": 64, "ffn_hidden_size": 256,
                "activation_func": "gelu", "bf16": True, "params_dtype": "bf16", "freeze": False,
                "layernorm_epsilon": 1e-06, "normalization": "RMSNorm"},
        },
        "text_decoder": {
            "model_id": "qwen2_5_lm", "num_layers": 4, "pipeline_num_layers": list(pipeline_text),
            "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "seq_length": 256,
            "max_position_embeddings": 2048, "vocab_size": 512, "rope_theta": 10000.0,
            "untie_embeddings_and_output_weights": True, "disable_bias_linear": True, "attention_dropout": 0.0,
            "init_method_std": 0.01, "hidden_dropout": 0.0, "position_embedding_type": "mrope",
            "normalization": "RMSNorm", "activation_func": "silu", "use_fused_rotary_pos_emb": True,
            "attention_softmax_in_fp32": True, "params_dtype": "bf16", "bf16": True, "parallel_output": True,
            "group_query_attention": True, "num_query_groups": 2, "mrope_section": [2, 3, 3], "rope_scaling": None,
            "gated_linear_unit": True, "bias_activation_fusion": True, "layernorm_epsilon": 1e-06,
            "add_bias_linear": False, "add_qkv_bias": True, **text},
        "text_encoder": None, "video_encoder": None, "patch": {"bridge_patch": False},
    }


def their_data_json(dataset: str, dataset_dir: str, model_dir: str) -> dict:
    """data_7b.json's schema; the records use other key names, which `attr` maps."""
    return {
        "dataset_param": {
            "dataset_type": "huggingface",
            "preprocess_parameters": {
                "model_name_or_path": model_dir, "use_fast_tokenizer": True, "split_special_tokens": False,
                "image_max_pixels": 262144, "image_min_pixels": 0, "video_max_pixels": 16384,
                "video_min_pixels": 0, "video_fps": 2.0, "video_maxlen": 64},
            "basic_parameters": {
                "template": "qwen2vl", "dataset_dir": dataset_dir, "dataset": dataset, "cache_dir": "./cache_dir",
                "train_on_prompt": False, "mask_history": False, "preprocessing_batch_size": 1000,
                "preprocessing_num_workers": 16, "max_samples": None, "tool_format": None},
            "attr": {
                "system": None, "images": "pictures", "videos": None, "messages": "dialog", "role_tag": "from",
                "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt", "observation_tag": None,
                "function_tag": None, "system_tag": None},
        },
        "dataloader_param": {
            "dataloader_mode": "sampler", "drop_last": True, "sampler_type": "BaseRandomBatchSampler",
            "collate_param": {"model_name": "qwen2vl", "ignore_pad_token_for_loss": True}, "pin_memory": True,
            "shuffle": True},
    }


def seven_b_command(port: int, model_json: str, data_json: str, load: str, save: str, **changed) -> list[str]:
    """finetune_qwen2_5_vl_7b.sh's torchrun command: its arguments in its order, sizes and paths changed, lr raised
    so that 20 iterations show learning."""
    values = {"nproc": "2", "tp": "1", "pp": "2", "cp": "1", "mbs": "1", "gbs": "4", "vocab": "512", "seq": "256",
              "lr": "1.0e-2", "iters": str(ITERATIONS), **changed}
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", values["nproc"], "--nnodes", "1", "--node_rank", "0", "--master_addr", "localhost",
        "--master_port", str(port),
        "-m", "mm_adaptor.train",
        "--use-mcore-models", "--tensor-model-parallel-size", values["tp"],
        "--pipeline-model-parallel-size", values["pp"], "--context-parallel-size", values["cp"],
        "--context-parallel-algo", "ulysses_cp_algo", "--micro-batch-size", values["mbs"],
        "--global-batch-size", values["gbs"], "--tokenizer-type", "NullTokenizer", "--vocab-size", values["vocab"],
        "--seq-length", values["seq"], "--make-vocab-size-divisible-by", "1", "--normalization", "RMSNorm",
        "--use-fused-rmsnorm", "--swiglu", "--use-fused-swiglu", "--no-masked-softmax-fusion", "--lr", values["lr"],
        "--lr-decay-style", "cosine", "--weight-decay", "0", "--train-iters", values["iters"],
        "--lr-warmup-fraction", "0.1", "--clip-grad", "0.0", "--adam-beta1", "0.9", "--adam-beta2", "0.999",
        "--seed", "42", "--bf16", "--load", load, "--use-flash-attn", "--variable-seq-lengths",
        "--use-distributed-optimizer", "--no-load-optim", "--no-load-rng", "--no-save-optim", "--no-save-rng",
        "--num-workers", "8", "--distributed-timeout-minutes", "20",
        "--mm-data", data_json, "--mm-model", model_json, "--mm-tool", "tools.json",
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "10000", "--eval-iters", "5000",
        "--save", save, "--ckpt-format", "torch", "--log-tps",
        "--distributed-backend", "gloo",
    ]


@pytest.fixture(scope="module")
def migration(tmp_path_factory):
    """The user's folder: model.json, data.json, their dataset and the checkpoint."""
    pytest.importorskip("transformers")
    from mm_adaptor.convert.hf_to_mcore import convert
    from mm_adaptor.convert.mindspeed_mm_write import write_mm_checkpoint
    from mm_adaptor.data.shapes import make_shapes
    from mm_adaptor.models.make_tiny_hf import make_tiny_hf

    root = tmp_path_factory.mktemp("mindspeed_mm_user")
    hf = root / "ckpt" / "hf_path" / "Qwen2.5-VL-tiny"
    make_tiny_hf(str(hf), "qwen2_5_vl", seed=0)
    tensors = _safetensors(hf)
    load = root / "ckpt" / "mm_path" / "Qwen2.5-VL-tiny"  # what mm-convert hf_to_mm writes, TP1 PP2
    write_mm_checkpoint(tensors, json.loads((hf / "config.json").read_text()), load, 1, [2, 0], [2, 2])
    convert(hf, root / "ckpt" / "mcore_path", tp=1)  # hf-to-mcore's, with hf/config.json
    ours = json.loads(Path(make_shapes(str(root / "data"), count=16, seed=0)).read_text())
    theirs = [{"dialog": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                          for m in r["messages"]], "pictures": r["images"]} for r in ours]
    (root / "data" / "their_captions.json").write_text(json.dumps(theirs))
    (root / "model_tiny.json").write_text(json.dumps(their_model_json()))
    (root / "data_tiny.json").write_text(json.dumps(their_data_json("./data/their_captions.json", "./data",
                                                                    "./ckpt/hf_path/Qwen2.5-VL-tiny")))
    return root, load, tensors


def _safetensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    return {name: t for shard in sorted(directory.glob("*.safetensors")) for name, t in load_file(str(shard)).items()}


def _run(command, cwd, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MM_ADAPTOR_DEVICE")}
    return subprocess.run(command, cwd=cwd, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=timeout)


def test_the_7b_script_trains_the_mm_checkpoint_on_two_cpu_ranks(migration):
    root, load, tensors = migration
    result = _run(seven_b_command(free_port(), "model_tiny.json", "data_tiny.json", str(load), "save"), root, 300)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [(int(i), float(loss), float(tps)) for i, loss, tps in LOSS.findall(result.stdout)]
    assert [i for i, _, _ in steps] == list(range(1, ITERATIONS + 1)), result.stdout[-2000:]
    losses = [loss for _, loss, _ in steps]
    assert losses[-1] <= 0.8 * losses[0], losses
    assert all(tps > 0 for _, _, tps in steps)
    # the notes: one line per argument without effect, on rank 0 only
    assert result.stdout.count("--mm-tool: no effect here") == 1, result.stdout[:2000]
    assert "holds no tokenizer.json: the tokenizer is --load's hf/, else the built-in byte tokenizer" in result.stdout
    assert result.stdout.count("no effect here (the trainer builds its batches in the rank") == 1  # data.json's
    # Megatron's loop, in the layout the model.json asked for, the checkpoint loaded, the vision encoder frozen
    assert "tensor-model-parallel size: 1, pipeline-model-parallel size: 2" in result.stdout, result.stdout[:3000]
    assert f"loaded MindSpeed-MM's checkpoint {load} (iteration 0)" in result.stdout
    assert "frozen: vision_model" in result.stdout
    # their --ckpt-format torch is Megatron's: the save is in its torch format, which Megatron's own converter (run
    # through the trainer) turns into torch_dist, and that converts to HF: the frozen vision encoder as loaded (in
    # bf16), the language model trained
    convert_command = seven_b_command(free_port(), "model_tiny.json", "data_tiny.json", "save", "converted")
    converted = _run([*convert_command, "--ckpt-convert-format", "torch_dist", "--ckpt-convert-save", "converted"],
                     root, 300)
    assert converted.returncode == 0, converted.stderr[-3000:]
    import torch

    from mm_adaptor.convert.mcore_to_hf import convert

    convert(root / "converted" / "torch_dist", root / "hf_trained")
    trained = _safetensors(root / "hf_trained")
    assert trained.keys() == tensors.keys()
    changed = {name for name, tensor in trained.items()
               if not torch.equal(tensor.float(), tensors[name].to(torch.bfloat16).float())}
    assert changed and not any("visual.blocks" in name or "patch_embed" in name for name in changed), changed
    assert any("language_model" in name or name.startswith("model.layers") for name in changed), changed


def _refused(capsys, monkeypatch, root, command, *words):
    """The command without torchrun, in this process: the refusal comes from parsing, before any rank."""
    from mm_adaptor.train import main

    monkeypatch.chdir(root)
    monkeypatch.setenv("MM_ADAPTOR_DEVICE", "cpu")  # what --distributed-backend gloo sets, undone after the test
    status = main(command[command.index("mm_adaptor.train") + 1:])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert status == 2, err
    assert len(lines) == 1 and all(w in lines[0] for w in words), lines
    assert "iteration" not in out  # no rank trained


def test_a_math_changing_argument_is_refused(migration, capsys, monkeypatch):
    root, load, _ = migration
    command = seven_b_command(0, "model_tiny.json", "data_tiny.json", str(load), "save")
    command[command.index("--make-vocab-size-divisible-by") + 1] = "128"
    _refused(capsys, monkeypatch, root, command, "--make-vocab-size-divisible-by 128", "output layer")


def test_a_model_json_contradicting_the_checkpoint_is_refused(migration, capsys, monkeypatch):
    root, load, _ = migration
    (root / "model_wide.json").write_text(json.dumps(their_model_json(ffn_hidden_size=96)))
    command = seven_b_command(0, "model_wide.json", "data_tiny.json", str(root / "ckpt" / "mcore_path"), "save")
    _refused(capsys, monkeypatch, root, command, "--mm-model model_wide.json", "ffn_hidden_size 96",
             "hf/config.json has 128")


def test_a_model_json_contradicting_the_mm_convert_checkpoint_is_refused(migration, capsys, monkeypatch):
    root, load, _ = migration
    (root / "model_deep.json").write_text(json.dumps(their_model_json(pipeline_text=(2, 3), num_layers=5)))
    command = seven_b_command(0, "model_deep.json", "data_tiny.json", str(load), "save")
    _refused(capsys, monkeypatch, root, command, f"--mm-model model_deep.json contradicts --load {load}",
             "4 layers under text_decoder.decoder.layers., the model has 5")


def test_a_data_json_whose_dataset_is_missing_is_refused(migration, capsys, monkeypatch):
    root, load, _ = migration
    data = their_data_json("./data/gone.json", "./data", "./ckpt/hf_path/Qwen2.5-VL-tiny")
    (root / "data_gone.json").write_text(json.dumps(data))
    command = seven_b_command(0, "model_tiny.json", "data_gone.json", str(load), "save")
    _refused(capsys, monkeypatch, root, command, "--mm-data data_gone.json", "./data/gone.json does not exist")
