"""Our megatron-core InternVL gives transformers' fp32 logits (TP1), for both InternViT variants (300M class: LayerNorm,
qkv bias; 6B class: RMSNorm, QK-norm over all heads), each with a Qwen2 language model with GQA and an untied output
layer, and the 300M class with a Qwen3 language model, loaded from the native layout and, renamed, from the OpenGVLab
one.

Measured (relative error = max |ours - HF| / max |HF|, fp32), prompts text only, one tile, 3 tiles + thumbnail, two
images, one 42 px tile (positions interpolated), the same with transformers 4.57.6 and 5.24.0, for both variants and
both layouts: text only 0 (bit-equal), with images 2.5e-7 .. 3.0e-7; with the Qwen3 language model 3.5e-7 .. 4.7e-7.
Tolerance FP32_TOLERANCE = 2e-6. Negative control: the pixel shuffle's neighbour order transposed gives 0.12 (6B
class) .. 0.19 (300M class)."""

import pytest
import torch

pytest.importorskip("transformers")

from internvl_reference import VARIANTS, hf_logits, hf_model, load_hf_weights, original_state, positions, prompts  # noqa: E402,E501

from mm_adaptor.models.internvl import model_provider, tiny_config  # noqa: E402

FP32_TOLERANCE = 2e-6
PROMPTS = ["text_only", "one_tile", "tiles_and_thumbnail", "two_images", "interpolated"]
VISUAL = PROMPTS[1:]
# and a Qwen3 language model (q/k RMSNorm per head, no qkv bias, head_dim 32 != hidden / heads)
MODELS = {**VARIANTS, "qwen3_lm": tiny_config("300m", language_model_type="qwen3", head_dim=32)}


def relative_error(ours, reference):
    return ((ours.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


@pytest.fixture(scope="module")
def references():
    """Per variant: (HF model, {prompt: (ids, pixels, HF logits)})."""
    out = {}
    for variant, config in MODELS.items():
        model, cases = hf_model(config), {}
        with torch.no_grad():
            for name, (ids, pixels) in prompts(config).items():
                cases[name] = (ids, pixels, hf_logits(model, ids, pixels))
        out[variant] = (model, cases)
    return out


@pytest.fixture(scope="module")
def ours(references):
    from gloo_rank import one_gloo_rank
    from megatron.core import tensor_parallel

    with one_gloo_rank():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        models = {}
        for variant, config in MODELS.items():
            state = references[variant][0].state_dict()
            for layout, hf_state in (("native", state), ("original", original_state(state, config))):
                model = model_provider(config).eval()
                load_hf_weights(model, hf_state, config, layout)
                models[variant, layout] = model
        yield models


def forward(model, ids, pixels):
    with torch.no_grad():
        return model(ids, positions(ids), pixel_values=pixels)


@pytest.mark.parametrize("layout", ["native", "original"])
@pytest.mark.parametrize("variant", MODELS)
def test_fp32_logits_equal_transformers(references, ours, variant, layout):
    errors = {}
    for name in PROMPTS:
        ids, pixels, expected = references[variant][1][name]
        logits = forward(ours[variant, layout], ids, pixels)
        assert logits.shape == expected.shape
        errors[name] = relative_error(logits, expected)
    assert max(errors.values()) < FP32_TOLERANCE, errors


def test_original_layout_holds_the_fused_qkv_and_layer_scales(references):
    config = VARIANTS["300m"]
    state = original_state(references["300m"][0].state_dict(), config)
    assert state["vision_model.encoder.layers.0.attn.qkv.weight"].shape == (3 * 32, 32)
    assert "vision_model.encoder.layers.1.ls2" in state and "mlp1.3.bias" in state
    assert "language_model.lm_head.weight" in state


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_mechanisms_ran(ours, variant):
    """The layer scales and (6B) the all-heads QK-norm are the modules the vision layers hold."""
    from mm_adaptor.models.internvl.vision import AllHeadsRMSNorm, ScaledRowParallelLinear

    layer = ours[variant, "native"].vision_model.decoder.layers[0]
    assert isinstance(layer.self_attention.linear_proj, ScaledRowParallelLinear)
    assert isinstance(layer.mlp.linear_fc2, ScaledRowParallelLinear)
    assert isinstance(layer.self_attention.q_layernorm, AllHeadsRMSNorm) == (variant == "6b")


@pytest.mark.parametrize("variant", VARIANTS)
def test_transposed_pixel_shuffle_differs(references, ours, variant):
    model = ours[variant, "native"]
    model.vision_projection.transposed_shuffle = True
    try:
        for name in VISUAL:
            ids, pixels, expected = references[variant][1][name]
            assert relative_error(forward(model, ids, pixels), expected) > 100 * FP32_TOLERANCE
    finally:
        model.vision_projection.transposed_shuffle = False
