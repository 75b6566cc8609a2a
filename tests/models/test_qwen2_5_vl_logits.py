"""Our megatron-core Qwen2.5-VL gives transformers' logits, with the same weights, in one process (TP1).

Measured on the tiny seeded model (relative error = max |ours - HF| / max |HF|):
- fp32: text only 0.0, one image 4.7e-7, two images 4.6e-7; tolerance FP32_TOLERANCE.
- bf16 (Float16Module, as the driver wraps it) against HF fp32: 7.7e-3 .. 8.1e-3, where HF's own bf16 model is off
  by 7.2e-3 .. 8.6e-3; tolerance: within BF16_TOLERANCE and within 1.5x HF's own bf16 error.
- 1-D positions (arange on all three axes) instead of the 3-D ones: 6.5e-3 .. 7.1e-3, far above FP32_TOLERANCE.
"""

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from hf_reference import hf_image_features, hf_inputs, hf_model, images, load_hf_weights, prompt  # noqa: E402

from mm_adaptor.models.qwen2_5_vl import model_provider, rope_index_for, tiny_config  # noqa: E402

FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 2e-2
CONFIG = tiny_config()


def relative_error(ours, reference):
    return ((ours.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def prompts():
    pixels, grid = images()
    first = int(grid[0].prod())
    return {
        "text_only": (prompt(CONFIG), None, None),
        "one_image": (prompt(CONFIG, grid[:1]), pixels[:first], grid[:1]),
        "two_images": (prompt(CONFIG, grid), pixels, grid),
    }


@pytest.fixture(scope="module")
def reference():
    """HF model, and per prompt: (input_ids, pixels, grid, 3-D positions, HF fp32 logits)."""
    model = hf_model(CONFIG)
    cases = {}
    with torch.no_grad():
        for name, (ids, pixels, grid) in prompts().items():
            positions, _ = rope_index_for(CONFIG, ids, grid)
            logits = model(**hf_inputs(CONFIG, ids, pixel_values=pixels, image_grid_thw=grid)).logits
            cases[name] = (ids, pixels, grid, positions, logits)
    return model, cases


@pytest.fixture(scope="module")
def megatron_rank():
    from gloo_rank import one_gloo_rank
    from megatron.core import tensor_parallel

    with one_gloo_rank():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield


def build(reference_model, config=CONFIG):
    model = model_provider(config).eval()
    load_hf_weights(model, reference_model.state_dict(), config)
    return model


@pytest.fixture(scope="module")
def ours_fp32(reference, megatron_rank):
    return build(reference[0])


@pytest.mark.parametrize("name", ["text_only", "one_image", "two_images"])
def test_fp32_logits_equal_transformers(reference, ours_fp32, name):
    ids, pixels, grid, positions, expected = reference[1][name]
    with torch.no_grad():
        logits = ours_fp32(ids, positions, pixel_values=pixels, image_grid_thw=grid)
    assert logits.shape == expected.shape
    assert relative_error(logits, expected) < FP32_TOLERANCE


def test_video_and_image_logits_equal_transformers(reference, ours_fp32):
    """A video (2 temporal patches, 2 s per grid) after an image: video pads get the tower's frames and the
    positions advance in time; pixels are random patches (the video processor needs torchvision)."""
    _, image_pixels, image_grid, _, _ = reference[1]["one_image"]
    video_grid = torch.tensor([[2, 8, 12]])
    video_pixels = torch.randn(int(video_grid.prod()), CONFIG.patch_dim, generator=torch.Generator().manual_seed(3))
    seconds = torch.tensor([2.0])
    ids = prompt(CONFIG, image_grid)
    video = [CONFIG.vision_start_token_id] + [CONFIG.video_token_id] * (int(video_grid.prod()) // 4) + [
        CONFIG.vision_start_token_id + 1, 7, 8]
    ids = torch.cat([ids, torch.tensor([video])], dim=1)
    positions, _ = rope_index_for(CONFIG, ids, image_grid, video_grid, seconds)
    with torch.no_grad():
        expected = reference[0](**hf_inputs(CONFIG, ids, pixel_values=image_pixels, image_grid_thw=image_grid,
                                            pixel_values_videos=video_pixels, video_grid_thw=video_grid,
                                            second_per_grid_ts=seconds)).logits
        logits = ours_fp32(ids, positions, pixel_values=image_pixels, image_grid_thw=image_grid,
                           pixel_values_videos=video_pixels, video_grid_thw=video_grid)
    assert relative_error(logits, expected) < FP32_TOLERANCE


def test_vision_embeddings_equal_transformers(reference, ours_fp32):
    ids, pixels, grid, _, _ = reference[1]["two_images"]
    with torch.no_grad():
        expected = hf_image_features(reference[0], pixels, grid)
        ours = ours_fp32.vision_embeddings(pixels, grid)
    assert ours.shape == expected.shape == (int(grid.prod(-1).sum()) // 4, CONFIG.hidden_size)
    assert relative_error(ours, expected) < FP32_TOLERANCE


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_one_dimensional_positions_change_the_logits(reference, ours_fp32, name):
    ids, pixels, grid, positions, expected = reference[1][name]
    flat = torch.arange(ids.shape[1]).expand(3, 1, -1)
    assert not torch.equal(flat, positions)
    with torch.no_grad():
        logits = ours_fp32(ids, flat, pixel_values=pixels, image_grid_thw=grid)
    assert relative_error(logits, expected) > 100 * FP32_TOLERANCE


def test_image_pads_without_pixels_are_refused(reference, ours_fp32):
    ids, _, _, positions, _ = reference[1]["one_image"]
    with pytest.raises(ValueError, match="no pixels"):
        ours_fp32(ids, positions)


@pytest.mark.parametrize("name", ["text_only", "two_images"])
def test_bf16_logits_near_transformers(reference, megatron_rank, name):
    from megatron.core.transformer.module import Float16Module

    config = dataclasses.replace(CONFIG, params_dtype="bfloat16")
    model = build(reference[0], config)
    ours = Float16Module(model.config, model)  # as the driver wraps it: every weight in bf16, fp32 logits out
    hf_bf16 = hf_model(CONFIG).to(torch.bfloat16)
    ids, pixels, grid, positions, expected = reference[1][name]
    with torch.no_grad():
        logits = ours(ids, positions, pixel_values=pixels, image_grid_thw=grid)
        hf_logits = hf_bf16(**hf_inputs(CONFIG, ids, pixel_values=pixels, image_grid_thw=grid)).logits
    assert model.language_model.output_layer.weight.dtype == torch.bfloat16
    assert model.vision_projection.layernorm.weight.dtype == torch.bfloat16
    error, hf_error = relative_error(logits, expected), relative_error(hf_logits, expected)
    assert error < BF16_TOLERANCE and error < 1.5 * hf_error, (error, hf_error)


def test_converter_tensors_load_and_give_transformers_logits(reference, megatron_rank):
    """The converter's pure API (whole tensors, Megatron names) fits this model at TP1 and gives the same logits."""
    from mm_adaptor.convert import family_for, hf_to_mcore_tensors
    from mm_adaptor.models.qwen2_5_vl import tiny_hf_config_dict

    tensors = hf_to_mcore_tensors(family_for(tiny_hf_config_dict(CONFIG)), reference[0].state_dict())
    model = model_provider(CONFIG).eval()
    own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    assert set(tensors) == own
    model.load_state_dict(tensors, strict=False)
    ids, pixels, grid, positions, expected = reference[1]["two_images"]
    with torch.no_grad():
        logits = model(ids, positions, pixel_values=pixels, image_grid_thw=grid)
    assert relative_error(logits, expected) < FP32_TOLERANCE


GRADIENT_PAIRS = {  # ours: transformers' (in-memory names)
    "vision_model.patch_embed.proj.weight": "model.visual.patch_embed.proj.weight",
    "vision_model.decoder.layers.0.self_attention.linear_proj.weight": "model.visual.blocks.0.attn.proj.weight",
    "vision_model.decoder.layers.1.mlp.linear_fc2.weight": "model.visual.blocks.1.mlp.down_proj.weight",
    "vision_projection.encoder.linear_fc2.weight": "model.visual.merger.mlp.2.weight",
    "language_model.embedding.word_embeddings.weight": "model.language_model.embed_tokens.weight",
    "language_model.decoder.layers.3.mlp.linear_fc2.weight": "model.language_model.layers.3.mlp.down_proj.weight",
    "language_model.output_layer.weight": "lm_head.weight",
}


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "full_recompute"])
def test_loss_and_gradients_equal_transformers(reference, megatron_rank, monkeypatch, recompute):
    """Training: the per-token loss (labels shifted by the caller) and gradients through both towers.
    Measured: loss 7.6e-8 relative, gradients 1.4e-7 .. 4.8e-7 relative (with and without activation recompute)."""
    from megatron.core import tensor_parallel

    checkpointed = []
    checkpoint = tensor_parallel.checkpoint
    monkeypatch.setattr(tensor_parallel, "checkpoint",
                        lambda function, *args: checkpointed.append(function) or checkpoint(function, *args))
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    ours = build(reference[0], dataclasses.replace(CONFIG, extra=extra)).train()
    theirs = hf_model(CONFIG)
    ids, pixels, grid, positions, _ = reference[1]["two_images"]
    hf_loss = theirs(**hf_inputs(CONFIG, ids, pixel_values=pixels, image_grid_thw=grid, labels=ids)).loss
    hf_loss.backward()
    labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    per_token = ours(ids, positions, labels=labels, pixel_values=pixels, image_grid_thw=grid)
    loss = per_token[:, :-1].mean()
    loss.backward()
    assert abs(loss.item() - hf_loss.item()) < FP32_TOLERANCE * hf_loss.item()
    # one checkpoint per layer: 2 vision + 4 language (the vision masks travel as one tensor through it)
    assert len(checkpointed) == (CONFIG.vision_depth + CONFIG.num_layers if recompute else 0)
    ours_params, their_params = dict(ours.named_parameters()), dict(theirs.named_parameters())
    for mine, hf_name in GRADIENT_PAIRS.items():
        expected = their_params[hf_name].grad
        grad = ours_params[mine].grad
        assert grad is not None and expected.abs().max() > 0, mine
        assert relative_error(grad, expected.reshape(grad.shape)) < 10 * FP32_TOLERANCE, mine
