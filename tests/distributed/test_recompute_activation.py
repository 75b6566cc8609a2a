"""--recompute-activation-function against unpatched Megatron: bit-for-bit in TP2+SP (fp32, bf16), PP2 (GeLU) and EP2
MoE (SequentialMLP experts), within the fused kernels' tolerance with --use-fused-swiglu and with GroupedMLP on
--use-fused-gmm; the saved-activation bytes per layer drop by the README's formula to the byte; the num-layers
variant; Megatron's block recompute alongside; a wrong recomputation fails the harness."""

import importlib.metadata

import pytest
from packaging.version import Version

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

FLAG = "--recompute-activation-function"
SEQ, MICRO_BATCH, HIDDEN = 64, 2, 64  # the driver's defaults
TOKENS = SEQ * MICRO_BATCH  # fc1 gathers the sequence under SP: every rank's activation sees all of it
SWIGLU_FFN = 192  # the driver's 8/3 x hidden, rounded up to a multiple of 64
GELU_FFN = 4 * HIDDEN


def expected_drop(tokens, ffn_per_rank, element_size, kept_per_output):
    """Bytes the activation no longer keeps: its output plus the [tokens, ffn/TP] tensors megatron's activation
    saved besides its input (kept_per_output counts them all, the output included)."""
    return kept_per_output * tokens * ffn_per_rank * element_size


def check(flags, layout, extra):
    result = harness.compare([FLAG, *flags], layout=layout, extra_args=extra, iters=4)
    assert result.passed, harness.format_comparison(result)
    return result


def drops(result):
    off, on = result.memory_off["saved_bytes_per_layer"], result.memory_on["saved_bytes_per_layer"]
    return {layer: off[layer] - on[layer] for layer in off if layer.startswith("layer")}


# kept_per_output: megatron's unfused GLU keeps silu(x1), x2 + glu_linear_offset and its output (3); the native
# swiglu and GeLU only their output (1); an expert's routing-probability scale keeps the unscaled output besides (+1);
# GroupedMLP's TorchScript-fused activation with probabilities only its output (1).
def test_tp2_sp_fp32_first_layer_only():
    """--recompute-activation-function-num-layers 1 of 2: only layer 1's bytes drop."""
    result = check(["--recompute-activation-function-num-layers", "1"], "tp2-sp", ["--swiglu"])
    assert result.tolerance.exact
    assert drops(result) == {"layer 1": expected_drop(TOKENS, SWIGLU_FFN // 2, 4, 3), "layer 2": 0}


def test_tp2_sp_bf16_alongside_megatron_block_recompute():
    """Layer 1 is recomputed whole by megatron (the feature leaves it alone), layer 2 takes the feature."""
    result = check([], "tp2-sp", ["--swiglu", "--bf16", "--recompute-granularity", "full",
                                  "--recompute-method", "block", "--recompute-num-layers", "1"])
    # megatron's checkpoint keeps layer 1's input outside the layer: nothing is saved inside it, off or on
    assert "layer 1" not in result.memory_on["saved_bytes_per_layer"]
    assert drops(result) == {"layer 2": expected_drop(TOKENS, SWIGLU_FFN // 2, 2, 3)}


def test_pp2_gelu_with_bias():
    result = check([], "pp2", [])
    assert drops(result) == {"layer 1": expected_drop(TOKENS, GELU_FFN, 4, 1)}  # rank 0 holds stage 1


# topk = number of experts: every expert sees every token of both EP ranks, so the bytes are known in advance.
LOCAL_EXPERTS, EXPERT_TOKENS = 2, 2 * TOKENS
EVERY_EXPERT = ["--swiglu", "--moe-router-topk", "4"]


def test_ep2_sequential_experts_with_fused_swiglu():
    """--use-fused-swiglu on in both runs: the comparison is bit-for-bit against the fused kernel unpatched."""
    result = check([], "ep2-moe", [*EVERY_EXPERT, "--use-fused-swiglu"])
    assert result.tolerance.exact
    want = LOCAL_EXPERTS * expected_drop(EXPERT_TOKENS, SWIGLU_FFN, 4, 2)
    assert drops(result) == {"layer 1": want, "layer 2": want}


def test_ep2_grouped_experts_on_fused_gmm():
    """--moe-grouped-gemm on --use-fused-gmm in both runs. megatron-core 0.16: GroupedMLP, through its own moe_act
    mechanism (its fused activation keeps only its output); 0.17+: SequentialMLP's experts grouped, megatron's
    MLP.forward over every local expert's rows (the unfused GLU's 3 plus the probability scale's 1)."""
    result = check([], "ep2-moe", [*EVERY_EXPERT, "--disable-bias-linear", "--moe-grouped-gemm", "--use-fused-gmm"])
    assert result.tolerance.exact
    grouped_mlp = Version(importlib.metadata.version("megatron-core")) < Version("0.17")
    if not grouped_mlp:
        stats = result.memory_on["feature_statistics"]["fused-gmm"]
        assert stats["SequentialMLP forwards as grouped GEMMs"] > 0, stats
    want = expected_drop(LOCAL_EXPERTS * EXPERT_TOKENS, SWIGLU_FFN, 4, 1 if grouped_mlp else 4)
    assert drops(result) == {"layer 1": want, "layer 2": want}


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_recomputing_from_a_perturbed_input_fails(precision):
    """The fp32 unpatched run is test_tp2_sp_fp32_first_layer_only's (cached)."""
    with harness.extra_feature_module("broken_recompute_activation_feature"):
        result = harness.compare(["--use-test-recompute-activation-perturbed"], layout="tp2-sp",
                                 extra_args=["--swiglu", *precision], iters=4)
    assert not result.passed
    assert result.grads.failures, "the wrong recomputation reaches the gradients"
