"""docs/memory.md's InternVL tables are models/internvl/memory.py's output, and its element count is the real
models': transformers' InternVLForConditionalGeneration of InternVL2.5-78B and of the 110B-class config (meta
device) has exactly as many parameters as the formula gives one rank at TP1 without pipeline splits. (The bytes
per rank are checked against measured ones in tests/vlm/test_internvl_training.py.)

Activations: the saved bytes the driver's recorder measures per layer (devices.memory.SavedTensorAccountant, rank 0,
first micro-batch) for `--model internvl-tiny` (4 Qwen2 layers, InternViT 300M class on one 28 px tile, seq 64,
micro-batch 1) equal memory.stage_activations' per-layer formula to the byte: TP1 and TP2+SP in fp32 with the
features off, TP2+SP with --use-flash-attn, --recompute-activation-function and --swap-attention (device and host),
under --swap-select all (every layer moves) and under the default bandwidth selection (each block's last layer,
"layer 4" and "vision layer 2", keeps everything on the device), TP2+SP in bf16, full recompute (only the layers'
inputs, kept outside the layers) and --freeze-vision (InternViT keeps nothing). The 6B-class InternViT layer
(RMSNorm, QK-norm over all heads), which the driver's preset does not build, is measured in process, fp32 and bf16.
Broken formulas are rejected: the SP view of the first layer's input forgotten, a feature left out, the other
swap selection."""

import dataclasses
from pathlib import Path

import pytest
import torch

from mm_adaptor.models.internvl import memory, tiny_config, tiny_hf_config_dict


def test_docs_tables_are_the_formulas_output(capsys):
    memory.main()
    printed = capsys.readouterr().out
    docs = (Path(__file__).parents[2] / "docs" / "memory.md").read_text()
    for table in printed.split("### ")[1:]:
        body = table.split("\n", 1)[1].strip()
        assert body in docs


@pytest.mark.parametrize("build", [memory.internvl2_5_78b, memory.internvl_110b_class])
def test_element_count_equals_transformers_model(build):
    transformers = pytest.importorskip("transformers")
    config = build()
    with torch.device("meta"):
        hf_config = transformers.InternVLConfig(**tiny_hf_config_dict(config))
        model = transformers.InternVLForConditionalGeneration(hf_config)
    assert sum(p.numel() for p in model.parameters()) == memory.stage_elements(config, 1, [config.num_layers], 0)


TINY_RUN = ["--model", "internvl-tiny", "--train-iters", "1", "--micro-batch-size", "1", "--seq-length", "64",
            "--timeout", "300"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
FEATURES = ["--use-flash-attn", "--recompute-activation-function", "--swap-attention", "--swap-min-bytes", "0"]
FEATURE_FIELDS = dict(bf16=False, tp=2, sp=True, flash_attn=True, recompute_activation=True, swap_attention=True,
                      swap_min_bytes=0)
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
RUNS = {  # name: (driver flags, memory.Activations fields)
    "tp1": ([], dict(bf16=False)),
    "tp2_sp": (TP2_SP, dict(bf16=False, tp=2, sp=True)),
    # --swap-select all: every layer swapped, the blocks' last layers included
    "tp2_sp_features": (TP2_SP + FEATURES + ["--swap-select", "all"], dict(FEATURE_FIELDS, swap_select="all")),
    # the default --swap-select bandwidth: the recorder counts the first micro-batch's forward, which is the first
    # pass of each block, one of the MEASURED_PASSES passes patches/transformer/swap_attention.py times the link in:
    # they swap every candidate but the block's last layer (never swapped), whatever the link's rate. So the formula's
    # upper bound (the last layer keeps everything, the others move as under "all") is exactly what that pass moves
    # (on the CPU the later passes almost always choose the same: a memcpy fits each candidate's window; not asserted).
    "tp2_sp_features_bandwidth": (TP2_SP + FEATURES, dict(FEATURE_FIELDS, swap_select="bandwidth")),
    "tp2_sp_bf16": (TP2_SP + ["--bf16"], dict(tp=2, sp=True)),
    "full_recompute": (FULL_RECOMPUTE, dict(bf16=False, full_recompute=True)),
    "tp1_frozen_vision": (["--freeze-vision"], dict(bf16=False, frozen_vision=True)),
}


@pytest.fixture(scope="module")
def measured():
    """{run: (saved bytes per layer on the device, in host memory)} of one training step each."""
    from mm_adaptor.harness.runner import parse_args, run

    out = {}
    for name, (flags, _fields) in RUNS.items():
        memory_ = run(parse_args([*TINY_RUN, *flags])).memory
        out[name] = memory_["saved_bytes_per_layer"], memory_["host_saved_bytes_per_layer"]
    return out


def _formula(name: str, **broken) -> tuple[dict, dict]:
    """memory.py's per-layer (device, host) bytes for a run, labelled as the recorder labels them."""
    config = tiny_config()
    a = memory.Activations(seq_length=64, tiles=1, **{**RUNS[name][1], **broken.pop("fields", {})})
    device, host = {}, {}
    for prefix, layers, saved in (("", config.num_layers, memory.language_layer_saved),
                                  ("vision ", 0 if a.frozen_vision else config.vision_layers_run,
                                   memory.vision_layer_saved)):
        for index in range(layers):
            kwargs = {"first_of_model": index == 0 and broken.get("first_of_model", True)} if not prefix else {}
            d, h = memory.placed(saved(config, a, **kwargs), a, first_of_block=index == 0,
                                 last_of_block=index == layers - 1)
            device[f"{prefix}layer {index + 1}"] = d
            if h:
                host[f"{prefix}layer {index + 1}"] = h
    return device, host


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n in RUNS if n != "full_recompute"])
def test_activation_formula_equals_measured_saved_bytes(measured, name):
    device, host = measured[name]
    layers = {k: v for k, v in device.items() if k != "outside layers"}
    assert (layers, host) == _formula(name)
    if name in ("tp2_sp", "tp2_sp_features"):  # fp32 (the norm keeps the input itself): its SP view, forgotten
        assert _formula(name, first_of_model=False)[0]["layer 1"] != device["layer 1"]
    if name.startswith("tp2_sp_features"):  # each feature ran: the formula without it does not fit
        for feature in ("flash_attn", "recompute_activation", "swap_attention"):
            assert _formula(name, fields={feature: False}) != (layers, host), feature
    if name == "tp2_sp_features":  # every layer moved, the blocks' last ones too
        assert set(host) == {"layer 1", "layer 2", "layer 3", "layer 4", "vision layer 1", "vision layer 2"}
        assert all(host.values())
        assert _formula(name, fields={"swap_select": "bandwidth"}) != (layers, host)
    if name == "tp2_sp_features_bandwidth":  # each block's last layer kept everything on the device
        assert set(host) == {"layer 1", "layer 2", "layer 3", "vision layer 1"} and all(host.values())
        assert device["layer 4"] == _formula(name, fields={"swap_attention": False})[0]["layer 4"]
        assert _formula(name, fields={"swap_select": "all"}) != (layers, host)


@pytest.mark.distributed
def test_full_recompute_keeps_only_the_layers_inputs(measured):
    """The checkpointed layers save nothing inside them; outside them, what the step saves beyond the unpatched
    run's outside-layer bytes is each layer's input (and the rope table once), as full_recompute_bytes says."""
    device, host = measured["full_recompute"]
    assert set(device) == {"outside layers"} and not host
    config = tiny_config()
    a = memory.Activations(seq_length=64, tiles=1, **RUNS["full_recompute"][1])
    expected = memory.full_recompute_bytes(config, a, config.num_layers, vision=True, first_of_model=True)
    assert device["outside layers"] - measured["tp1"][0]["outside layers"] == expected
    per_layer = sum(v for k, v in measured["tp1"][0].items() if k != "outside layers")
    assert expected < per_layer / 10


@pytest.mark.parametrize("bf16", [False, True])
def test_6b_class_vision_layer_formula(bf16):
    """InternViT-6B's layer (RMSNorm, QK-norm over all heads, no qkv bias) on 3 tiles: measured in process with the
    recorder's accountant, TP1."""
    from gloo_rank import one_gloo_rank
    from megatron.core import tensor_parallel

    from mm_adaptor.devices.memory import SavedTensorAccountant
    from mm_adaptor.models.internvl import vision_transformer_config
    from mm_adaptor.models.internvl.vision import VisionModel

    config = tiny_config("6b", params_dtype="bfloat16" if bf16 else "float32")
    with one_gloo_rank():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        model = VisionModel(config, vision_transformer_config(config))
        accountant = SavedTensorAccountant([model])
        with accountant.hooks():
            model(torch.randn(3, 3, config.image_size, config.image_size))
        measured_ = accountant.bytes_per_layer()
        accountant.close()
    a = memory.Activations(tiles=3, bf16=bf16)
    expected = memory.placed(memory.vision_layer_saved(config, a), a)[0]
    assert measured_["layer 1"] == measured_["layer 2"] == expected
    without_qk_norm = dataclasses.replace(config, vision_qk_norm=False)
    assert memory.placed(memory.vision_layer_saved(without_qk_norm, a), a)[0] != expected
