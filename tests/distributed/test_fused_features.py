"""--use-fused-rmsnorm / --use-fused-swiglu / --use-fused-rotary-pos-emb / --use-flash-attn against unpatched Megatron:
TP2+SP and PP2 (SwiGLU also in EP2 MoE experts), fp32 and bf16, each alone and all together, within each feature's
declared tolerance."""

import pytest

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

MODEL = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope"]
FEATURES = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn"]


def assert_saves_activations(result, what):
    off, on = result.memory_off["saved_bytes_per_layer"], result.memory_on["saved_bytes_per_layer"]
    for layer in (k for k in off if k.startswith("layer")):
        assert on[layer] < off[layer], f"{layer}: {what} must save fewer activation bytes"


def check(flags, layout, precision):
    result = harness.compare(flags, layout=layout, extra_args=[*MODEL, *precision], iters=4)
    assert result.passed, harness.format_comparison(result)
    return result


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2"])
@pytest.mark.parametrize("flag", FEATURES)
def test_each_fused_feature(flag, layout, precision):
    result = check([flag], layout, precision)
    if flag == "--use-fused-swiglu":
        assert_saves_activations(result, "the fused SwiGLU")


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_fused_swiglu_reaches_moe_experts(precision):
    """EP2 MoE with SequentialMLP experts: each expert's SwiGLU, scaled by its routing probabilities, is fused."""
    result = check(["--use-fused-swiglu"], "ep2-moe", precision)
    assert_saves_activations(result, "the experts' fused SwiGLU")


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_all_fused_features_together(precision):
    check(FEATURES, "tp2-sp", precision)


def test_flash_attention_saves_the_score_matrix():
    """Per layer, the fused kernels keep no [b, heads, s, s] probabilities: at least that many bytes less."""
    result = check(["--use-flash-attn"], "tp2-sp", [])
    micro_batch, heads_per_rank, seq = 2, 4 // 2, 64  # the driver's defaults at TP2
    score_matrix_bytes = micro_batch * heads_per_rank * seq * seq * 4
    off, on = result.memory_off["saved_bytes_per_layer"], result.memory_on["saved_bytes_per_layer"]
    for layer in (k for k in off if k.startswith("layer")):
        assert off[layer] - on[layer] >= score_matrix_bytes, (layer, off[layer], on[layer], score_matrix_bytes)
