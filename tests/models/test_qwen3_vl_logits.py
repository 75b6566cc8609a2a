"""Our megatron-core Qwen3-VL and Qwen3-VL-MoE give transformers' logits, with the same weights, in one process
(TP1), and read the configs both transformers majors save.

Measured on the tiny seeded models (relative error = max |ours - HF| / max |HF|, fp32), over the prompts text
only, one image, two images of different non-square sizes, a 4-frame video, an image and the video:
- transformers 4.57.6: dense 3.3e-7 .. 5.8e-7, MoE 4.1e-7 .. 4.3e-7; transformers 5.24.0 (PYTHONPATH=/work/tf5):
  dense 3.3e-7 .. 5.0e-7, MoE 4.2e-7 .. 5.6e-7. Tolerance FP32_TOLERANCE = 2e-6.
- training (dense, image + video): loss 0 (4.57) / 7.6e-8 (5.24) relative, gradients 1.0e-7 .. 5.8e-7 relative
  with and without activation recompute; tolerance 10 x FP32_TOLERANCE.
- negative controls, each far above the tolerance: DeepStack injection off 0.65 .. 1.1; megatron's chunked M-RoPE
  (TTT HHH WWW) instead of the interleaved one 2.5e-2 .. 0.10 (text only is the same either way: its three position
  axes are equal); experts 0 and 1 exchanged in every MoE layer 4.2e-2 .. 6.2e-2.
"""

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers")

from qwen3_reference import (  # noqa: E402
    TRANSFORMERS_5, hf_logits, hf_model, hf_positions, images, load_hf_weights, megatron_tensors, pictures, prompt,
    token_types, transformers_processor, video,
)

from mm_adaptor.models.qwen3_vl import config_from_hf, model_provider, tiny_config, tiny_hf_config_dict  # noqa: E402

FP32_TOLERANCE = 2e-6
FAMILIES = {"dense": tiny_config(), "moe": tiny_config(moe=True)}
PROMPTS = ["text_only", "one_image", "two_images", "video", "image_and_video"]
VISUAL = PROMPTS[1:]


def relative_error(ours, reference):
    return ((ours.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def prompts(config):
    """name -> (input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)."""
    pixels, grid = images()
    video_pixels, video_grid = video()
    first = int(grid[0].prod())
    return {
        "text_only": (prompt(config, text_lengths=(12, 4, 3)), None, None, None, None),
        "one_image": (prompt(config, grid[:1]), pixels[:first], grid[:1], None, None),
        "two_images": (prompt(config, grid), pixels, grid, None, None),
        "video": (prompt(config, None, video_grid), None, None, video_pixels, video_grid),
        "image_and_video": (prompt(config, grid[:1], video_grid), pixels[:first], grid[:1], video_pixels, video_grid),
    }


@pytest.fixture(scope="module")
def references():
    """Per family: (HF model, {prompt: (inputs, transformers' 3-D positions, HF fp32 logits)})."""
    out = {}
    for family, config in FAMILIES.items():
        model, cases = hf_model(config), {}
        with torch.no_grad():
            for name, (ids, pixels, grid, video_pixels, video_grid) in prompts(config).items():
                positions = hf_positions(model, config, ids, grid, video_grid)
                logits = hf_logits(model, config, ids, pixels, grid, video_pixels, video_grid)
                cases[name] = ((ids, pixels, grid, video_pixels, video_grid), positions, logits)
        out[family] = (model, cases)
    return out


@pytest.fixture(scope="module")
def megatron_rank():
    from gloo_rank import one_gloo_rank
    from megatron.core import tensor_parallel

    with one_gloo_rank():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield


def build(reference_model, config):
    model = model_provider(config).eval()
    load_hf_weights(model, reference_model.state_dict(), config)
    return model


def forward(model, inputs, positions):
    ids, pixels, grid, video_pixels, video_grid = inputs
    with torch.no_grad():
        return model(ids, positions, pixel_values=pixels, image_grid_thw=grid, pixel_values_videos=video_pixels,
                     video_grid_thw=video_grid)


@pytest.fixture(scope="module")
def ours(references, megatron_rank):
    return {family: build(references[family][0], config) for family, config in FAMILIES.items()}


@pytest.mark.parametrize("name", PROMPTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_equal_transformers(references, ours, family, name):
    inputs, positions, expected = references[family][1][name]
    logits = forward(ours[family], inputs, positions)
    assert logits.shape == expected.shape
    assert relative_error(logits, expected) < FP32_TOLERANCE


def _hf_vision(model, pixels, grid):
    out = model.model.visual(pixels, grid_thw=grid)
    if isinstance(out, tuple):  # 4.57
        return out[0], list(out[1])
    return out.pooler_output, list(out.deepstack_features)


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_and_deepstack_embeddings_equal_transformers(references, ours, family):
    (_, pixels, grid, _, _), _, _ = references[family][1]["two_images"]
    with torch.no_grad():
        merged, deepstack = ours[family].vision_embeddings(pixels, grid)
        expected, expected_deepstack = _hf_vision(references[family][0], pixels, grid)
    assert merged.shape == expected.shape == (int(grid.prod(-1).sum()) // 4, FAMILIES[family].hidden_size)
    assert len(deepstack) == len(expected_deepstack) == 2
    for got, want in zip([merged, *deepstack], [expected, *expected_deepstack]):
        assert relative_error(got, want) < FP32_TOLERANCE


def test_image_pixels_are_transformers_image_processors():
    """The pictures go through the repository's preprocessing (mm_adaptor.data.images); transformers' image
    processor with Qwen3-VL's values gives the same pixels and grids."""
    pixels, grid = images()
    expected = transformers_processor()(images=pictures(), return_tensors="pt")
    assert torch.equal(grid, expected["image_grid_thw"])
    assert torch.equal(pixels, expected["pixel_values"])
    assert grid.tolist() == [[1, 6, 10], [1, 8, 4]]  # not resized: 96 x 160 and 128 x 64 pixels


def test_video_is_two_temporal_patches_of_four_frames():
    pixels, grid = video()
    assert grid.tolist() == [[2, 4, 6]] and pixels.shape == (48, 3 * 2 * 16 * 16)


@pytest.mark.parametrize("name", VISUAL)
@pytest.mark.parametrize("family", FAMILIES)
def test_negative_control_deepstack_off(references, megatron_rank, family, name):
    model, cases = references[family]
    inputs, positions, expected = cases[name]
    off = build(model, dataclasses.replace(FAMILIES[family], deepstack=False))
    assert relative_error(forward(off, inputs, positions), expected) > 1000 * FP32_TOLERANCE
    text_inputs, text_positions, text_expected = cases["text_only"]  # nothing to inject without visual tokens
    assert relative_error(forward(off, text_inputs, text_positions), text_expected) < FP32_TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_negative_control_chunked_mrope(references, megatron_rank, family):
    """megatron's own (chunked TTT HHH WWW) multimodal rope instead of the interleaved one; text only is the same
    either way (its three position axes are equal)."""
    model, cases = references[family]
    chunked = build(model, dataclasses.replace(FAMILIES[family], mrope_interleaved=False))
    for name in VISUAL:
        inputs, positions, expected = cases[name]
        assert relative_error(forward(chunked, inputs, positions), expected) > 1000 * FP32_TOLERANCE, name


def test_negative_control_experts_swapped(references, megatron_rank):
    """Experts 0 and 1 of every MoE layer exchanged (what a wrong expert order in the mapping would do)."""
    model, cases = references["moe"]
    swapped = build(model, FAMILIES["moe"])
    with torch.no_grad():
        for layer in swapped.language_model.decoder.layers:
            if hasattr(layer.mlp, "experts"):
                first, second = layer.mlp.experts.local_experts[:2]
                for a, b in zip(first.parameters(), second.parameters()):
                    held = a.clone()
                    a.copy_(b)
                    b.copy_(held)
    for name in PROMPTS:
        inputs, positions, expected = cases[name]
        assert relative_error(forward(swapped, inputs, positions), expected) > 1000 * FP32_TOLERANCE, name


def test_moe_layers_where_transformers_has_them(references, ours):
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    theirs = references["moe"][0].model.language_model.layers
    for layer, hf_layer in zip(ours["moe"].language_model.decoder.layers, theirs):
        sparse = type(hf_layer.mlp).__name__.endswith("SparseMoeBlock")
        assert isinstance(layer.mlp, MoELayer if sparse else MLP), layer.layer_number
        assert not sparse or isinstance(layer.mlp.experts, SequentialMLP)
    assert [isinstance(layer.mlp, MoELayer) for layer in ours["moe"].language_model.decoder.layers] == [
        True, True, False, True]
    assert all(isinstance(layer.mlp, MLP) for layer in ours["dense"].language_model.decoder.layers)


def test_all_moe_layers_equal_transformers(references, megatron_rank):
    """No mlp_only_layers (as the released MoE checkpoints): every layer MoE."""
    config = dataclasses.replace(FAMILIES["moe"], mlp_only_layers=())
    reference = hf_model(config)
    (ids, pixels, grid, video_pixels, video_grid), _, _ = references["moe"][1]["image_and_video"]
    with torch.no_grad():
        positions = hf_positions(reference, config, ids, grid, video_grid)
        expected = hf_logits(reference, config, ids, pixels, grid, video_pixels, video_grid)
    model = build(reference, config)
    assert model.language_model.config.moe_layer_freq == [1, 1, 1, 1]
    logits = forward(model, (ids, pixels, grid, video_pixels, video_grid), positions)
    assert relative_error(logits, expected) < FP32_TOLERANCE


def test_image_pads_without_pixels_are_refused(references, ours):
    (ids, *_), positions, _ = references["dense"][1]["one_image"]
    with pytest.raises(ValueError, match="no pixels"):
        ours["dense"](ids, positions)


GRADIENT_PAIRS = {  # ours: transformers' (in-memory names)
    "vision_model.patch_embed.proj.weight": "model.visual.patch_embed.proj.weight",
    "vision_model.pos_embed.weight": "model.visual.pos_embed.weight",
    "vision_model.decoder.layers.0.self_attention.linear_proj.weight": "model.visual.blocks.0.attn.proj.weight",
    "deepstack_projections.1.encoder.linear_fc2.weight": "model.visual.deepstack_merger_list.1.linear_fc2.weight",
    "language_model.decoder.layers.0.mlp.linear_fc2.weight": "model.language_model.layers.0.mlp.down_proj.weight",
    "language_model.output_layer.weight": "lm_head.weight",
}


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "full_recompute"])
def test_loss_and_gradients_equal_transformers(references, megatron_rank, monkeypatch, recompute):
    """Training through both towers and the DeepStack path (image and video): per-token loss and gradients, with
    and without activation recompute (the DeepStack features travel with the checkpointed layer inputs)."""
    from megatron.core import tensor_parallel

    checkpointed = []
    checkpoint = tensor_parallel.checkpoint
    monkeypatch.setattr(tensor_parallel, "checkpoint",
                        lambda function, *args: checkpointed.append(function) or checkpoint(function, *args))
    config = FAMILIES["dense"]
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    ours = build(references["dense"][0], dataclasses.replace(config, extra=extra)).train()
    theirs = hf_model(config)
    (ids, pixels, grid, video_pixels, video_grid), positions, _ = references["dense"][1]["image_and_video"]
    hf_loss = theirs(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, pixel_values_videos=video_pixels,
                     video_grid_thw=video_grid, labels=ids,
                     **({"mm_token_type_ids": token_types(config, ids)} if TRANSFORMERS_5 else {})).loss
    hf_loss.backward()
    labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    per_token = ours(ids, positions, labels=labels, pixel_values=pixels, image_grid_thw=grid,
                     pixel_values_videos=video_pixels, video_grid_thw=video_grid)
    loss = per_token[:, :-1].mean()
    loss.backward()
    assert abs(loss.item() - hf_loss.item()) < FP32_TOLERANCE * hf_loss.item()
    # one checkpoint per layer: 3 vision layers (twice: the image and the video) + 4 language layers
    assert len(checkpointed) == (2 * config.vision_depth + config.num_layers if recompute else 0)
    ours_params, their_params = dict(ours.named_parameters()), dict(theirs.named_parameters())
    for mine, hf_name in GRADIENT_PAIRS.items():
        expected, grad = their_params[hf_name].grad, ours_params[mine].grad
        assert grad is not None and expected.abs().max() > 0, mine
        assert relative_error(grad, expected.reshape(grad.shape)) < 10 * FP32_TOLERANCE, mine


# ---- configs: what transformers 4.57 and 5.24 save for the same tiny models (config.json, verbatim) ----

SAVED_BY_4_57 = json.loads("""
{"dense": {"image_token_id": 500, "model_type": "qwen3_vl", "text_config": {"attention_bias": false,
"attention_dropout": 0.0, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
"intermediate_size": 128, "max_position_embeddings": 2048, "model_type": "qwen3_vl_text", "num_attention_heads": 4,
"num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": {"mrope_interleaved": true,
"mrope_section": [6, 5, 5], "rope_type": "default"}, "rope_theta": 10000.0, "use_cache": true, "vocab_size": 512},
"tie_word_embeddings": false, "transformers_version": "4.57.6", "video_token_id": 501, "vision_config":
{"deepstack_visual_indexes": [0, 1], "depth": 3, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 64,
"in_channels": 3, "initializer_range": 0.02, "intermediate_size": 96, "model_type": "qwen3_vl", "num_heads": 4,
"num_position_embeddings": 64, "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
"temporal_patch_size": 2}, "vision_end_token_id": 503, "vision_start_token_id": 502}, "moe": {"image_token_id": 500,
"model_type": "qwen3_vl_moe", "text_config": {"attention_bias": false, "attention_dropout": 0.0,
"decoder_sparse_step": 1, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
"intermediate_size": 128, "max_position_embeddings": 2048, "mlp_only_layers": [2], "model_type":
"qwen3_vl_moe_text", "moe_intermediate_size": 48, "norm_topk_prob": true, "num_attention_heads": 4, "num_experts":
4, "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
"rope_scaling": {"mrope_interleaved": true, "mrope_section": [6, 5, 5], "rope_type": "default"}, "rope_theta":
10000.0, "router_aux_loss_coef": 0.001, "use_cache": true, "vocab_size": 512}, "tie_word_embeddings": false,
"transformers_version": "4.57.6", "video_token_id": 501, "vision_config": {"deepstack_visual_indexes": [0, 1],
"depth": 3, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 64, "in_channels": 3, "initializer_range": 0.02,
"intermediate_size": 96, "model_type": "qwen3_vl_moe", "num_heads": 4, "num_position_embeddings": 64,
"out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}, "vision_end_token_id":
503, "vision_start_token_id": 502}}
""")
SAVED_BY_5_24 = json.loads("""
{"dense": {"image_token_id": 500, "model_type": "qwen3_vl", "text_config": {"attention_bias": false,
"attention_dropout": 0.0, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
"intermediate_size": 128, "max_position_embeddings": 2048, "model_type": "qwen3_vl_text", "num_attention_heads": 4,
"num_hidden_layers": 4, "num_key_value_heads": 2, "pad_token_id": null, "rms_norm_eps": 1e-06, "rope_parameters":
{"mrope_interleaved": true, "mrope_section": [6, 5, 5], "rope_theta": 10000.0, "rope_type": "default"}, "use_cache":
true, "vocab_size": 512}, "tie_word_embeddings": false, "transformers_version": "5.24.0", "video_token_id": 501,
"vision_config": {"deepstack_visual_indexes": [0, 1], "depth": 3, "hidden_act": "gelu_pytorch_tanh", "hidden_size":
64, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 96, "model_type": "qwen3_vl_vision",
"num_heads": 4, "num_position_embeddings": 64, "out_hidden_size": 64, "patch_size": 16, "rope_parameters":
{"rope_theta": 10000.0, "rope_type": "axial"}, "spatial_merge_size": 2, "temporal_patch_size": 2},
"vision_end_token_id": 503, "vision_start_token_id": 502}, "moe": {"image_token_id": 500, "model_type":
"qwen3_vl_moe", "text_config": {"attention_bias": false, "attention_dropout": 0.0, "bos_token_id": null,
"decoder_sparse_step": 1, "eos_token_id": null, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
"initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 2048, "mlp_only_layers": [2],
"model_type": "qwen3_vl_moe_text", "moe_intermediate_size": 48, "num_attention_heads": 4, "num_experts_per_tok": 2,
"num_hidden_layers": 4, "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": false,
"pad_token_id": null, "rms_norm_eps": 1e-06, "rope_parameters": {"mrope_interleaved": true, "mrope_section": [6, 5,
5], "rope_theta": 10000.0, "rope_type": "default"}, "router_aux_loss_coef": 0.001, "sliding_window": null,
"tie_word_embeddings": true, "use_cache": true, "vocab_size": 512}, "tie_word_embeddings": false,
"transformers_version": "5.24.0", "video_token_id": 501, "vision_config": {"deepstack_visual_indexes": [0, 1],
"depth": 3, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 64, "in_channels": 3, "initializer_range": 0.02,
"intermediate_size": 96, "model_type": "qwen3_vl_moe_vision", "num_heads": 4, "num_position_embeddings": 64,
"out_hidden_size": 64, "patch_size": 16, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
"spatial_merge_size": 2, "temporal_patch_size": 2}, "vision_end_token_id": 503, "vision_start_token_id": 502}}
""")


@pytest.mark.parametrize("family", FAMILIES)
def test_configs_saved_by_both_transformers_majors_read_the_same(family):
    """5.24 writes rope_parameters (theta inside), the vision rope's own rope_parameters, num_local_experts, and
    tie_word_embeddings true in the MoE text config beside the top-level false it decides by."""
    old, new = SAVED_BY_4_57[family], SAVED_BY_5_24[family]
    assert "rope_parameters" in new["text_config"] and "rope_scaling" in old["text_config"]
    assert config_from_hf(old) == config_from_hf(new) == FAMILIES[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trips_through_transformers(family):
    import transformers

    config = FAMILIES[family]
    cls = transformers.Qwen3VLMoeConfig if config.is_moe else transformers.Qwen3VLConfig
    assert config_from_hf(cls(**tiny_hf_config_dict(config)).to_dict()) == config
    assert config_from_hf(json.loads(json.dumps(tiny_hf_config_dict(config)))) == config


def _drop_interleave(d):
    del d["text_config"]["rope_scaling"]["mrope_interleaved"]


def _more_experts_than_ep(d):
    d["text_config"]["num_experts"] = 3


REFUSALS = [  # (change to the MoE tiny HF config dict, config_from_hf overrides, message)
    (_drop_interleave, {}, "mrope_interleaved"),
    (lambda d: d["vision_config"].update(out_hidden_size=32), {}, "out_hidden_size 32"),
    (lambda d: d["vision_config"].update(deepstack_visual_indexes=[0, 3]), {}, "below the depth 3"),
    (_more_experts_than_ep, {"expert_model_parallel_size": 2}, "3 experts do not divide"),
    (None, {"pipeline_model_parallel_size": 2, "pipeline_layers": [1, 3]}, "DeepStack needs the first 2"),
    (lambda d: d.update(model_type="qwen2_5_vl"), {}, "is not Qwen3-VL"),
    (lambda d: d["text_config"].update(attention_bias=True), {}, "attention_bias"),
]


@pytest.mark.parametrize("change, overrides, message", REFUSALS, ids=[r[2] for r in REFUSALS])
def test_configs_we_cannot_build_are_refused_in_one_line(change, overrides, message):
    hf_config = tiny_hf_config_dict(FAMILIES["moe"])
    if change:
        change(hf_config)
    with pytest.raises(ValueError, match=message) as error:
        config_from_hf(hf_config, **overrides)
    assert "\n" not in str(error.value)


def test_pipeline_split_with_deepstack_off_may_put_one_layer_first():
    config = config_from_hf(tiny_hf_config_dict(), deepstack=False, pipeline_model_parallel_size=2,
                            pipeline_layers=[1, 3])
    assert config.pipeline_layers == [1, 3]


# ---- the mapping: every tensor of both models, and the three forms experts come in ----


@pytest.mark.parametrize("family", FAMILIES)
def test_mapping_covers_every_tensor_both_ways(references, ours, family):
    """Every tensor and _extra_state of our model has a rule, every HF tensor is one; back to HF exactly."""
    from mm_adaptor.convert import mcore_to_hf_tensors
    from mm_adaptor.models.qwen3_vl import mapping

    rules = mapping.family(tiny_hf_config_dict(FAMILIES[family]))
    hf_state = references[family][0].state_dict()
    tensors = megatron_tensors(hf_state, FAMILIES[family])
    own = ours[family].state_dict()
    assert set(tensors) == {k for k in own if not k.endswith("._extra_state")}
    extra = {name.format(i=layer) for name, stack in rules.extra_states.items() for layer in rules.stack_layers(stack)}
    assert extra == {k for k in own if k.endswith("._extra_state")}
    back = mcore_to_hf_tensors(rules, tensors, fused_major=5 if TRANSFORMERS_5 else 4)
    assert set(back) == set(hf_state)
    assert all(torch.equal(back[name], hf_state[name]) for name in hf_state)


def test_expert_forms_give_the_same_megatron_tensors(references):
    """transformers 4.57's fused experts (E, H, 2I) / (E, I, H), 5.x's transposed ones and one tensor set per expert
    all give the same Megatron tensors (the converter splits the fused ones as the saving version says)."""
    from mm_adaptor.convert import fuse, mcore_to_hf_tensors
    from mm_adaptor.models.qwen3_vl import mapping

    config = FAMILIES["moe"]
    rules = mapping.family(tiny_hf_config_dict(config))
    whole = megatron_tensors(references["moe"][0].state_dict(), config)
    per_expert = mcore_to_hf_tensors(rules, whole)
    assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in per_expert
    gate_up = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    for saved_by, major, shape in (("4.57.6", 4, (4, 64, 96)), ("5.24.0", 5, (4, 96, 64)), (None, None, None)):
        state = per_expert if major is None else fuse(rules, per_expert, major)
        assert major is None or state[gate_up].shape == shape
        again = megatron_tensors(state, config, saved_by)
        assert again.keys() == whole.keys() and all(torch.equal(again[k], whole[k]) for k in whole)
