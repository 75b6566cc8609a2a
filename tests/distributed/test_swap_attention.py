"""--swap-attention against unpatched Megatron: bit-for-bit with the memory rows to the byte (TP2+SP fp32, every layer
swapped: --swap-select all), with several micro-batches in flight on virtual pipeline stages (bf16, the bandwidth
selection: the last layer of each model chunk kept, the others timed and chosen), beside
--recompute-activation-function and the fused kernels on EP2 MoE (the bandwidth selection); a prefetch that returns
another layer's tensors fails the harness in fp32 and bf16. (`mm-adaptor check --layout all` covers the other
layouts; see the README.)"""

import pytest

from mm_adaptor import harness

pytestmark = pytest.mark.distributed

SWAP = ["--swap-attention", "--swap-min-bytes", "0"]  # the default selection: bandwidth
SWAP_ALL = [*SWAP, "--swap-select", "all"]
MODEL = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
SWAPPED = ("input_layernorm", "self_attention", "pre_mlp_layernorm")
SEQ, MICRO_BATCH, HIDDEN = 64, 2, 64  # the driver's defaults


def check(flags, layout, extra):
    result = harness.compare(flags, layout=layout, extra_args=extra, iters=4)
    assert result.passed, harness.format_comparison(result)
    assert result.tolerance.exact
    return result


def swapped_bytes(memory, residence):
    return {layer: sum(modules.get(m, {}).get(residence, 0) for m in SWAPPED)
            for layer, modules in memory["saved_bytes_per_module"].items() if layer.startswith("layer")}


def test_tp2_sp_fp32_moves_every_swapped_byte_but_the_block_input():
    result = check(SWAP_ALL, "tp2-sp", MODEL)
    off, on = result.memory_off, result.memory_on
    # the block's input (the embedding's output, [seq/TP, batch, hidden] fp32) is still held by the model: it
    # stays; everything else the three modules saved left the device, and arrived in host memory
    block_input = SEQ // 2 * MICRO_BATCH * HIDDEN * 4
    assert swapped_bytes(on, "device") == {"layer 1": block_input, "layer 2": 0}
    assert swapped_bytes(on, "host") == {layer: b - swapped_bytes(on, "device")[layer]
                                         for layer, b in swapped_bytes(off, "device").items()}
    assert on["host_saved_bytes_per_layer"] == swapped_bytes(on, "host")
    stats = on["feature_statistics"]["swap-attention"]
    assert stats.get("fetched_on_demand", 0) == 0, "every layer came back ahead of its backward"
    assert stats["select"] == "all" and (stats["layers_swapped"], stats["layers"]) == (2, 2)


def test_pp2_vpp2_bf16_keys_by_micro_batch_and_keeps_each_chunks_last_layer():
    """Two virtual stages of two layers per rank, four micro-batches: several forwards in flight before their
    backwards. The first micro-batch (the measured pass, where every candidate swaps) moved the first layer of rank
    0's first chunk and kept its last; after two timed passes per chunk each chunk chose among its first layer."""
    result = check(SWAP, "pp2-vpp2", [*MODEL, "--bf16", "--num-layers", "8",
                                      "--num-layers-per-virtual-pipeline-stage", "2"])
    host = result.memory_on["host_saved_bytes_per_layer"]
    assert host.get("layer 1", 0) > 0 and host.get("layer 2", 0) == 0, host
    stats = result.memory_on["feature_statistics"]["swap-attention"]
    assert stats["select"] == "bandwidth" and stats["selection_pending"] == 0, stats
    assert stats["layers"] == 4 and stats["layers_swapped"] <= 2 and stats["link_gb_per_s"] > 0, stats
    assert stats["last_layer_passes_kept"] > 0 and stats["offloaded_bytes"] > 0, stats


def test_ep2_moe_with_recompute_activation_and_fused_kernels():
    """Both features and the fused kernels in both runs but the feature: bit-for-bit against the fused path."""
    fused = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn"]
    result = check([*SWAP, "--recompute-activation-function"], "ep2-moe", [*MODEL, *fused])
    host = result.memory_on["host_saved_bytes_per_layer"]
    assert host.get("layer 1", 0) > 0 and host.get("layer 2", 0) == 0, host


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_prefetching_another_layers_tensors_fails(precision):
    """The fp32 unpatched run is test_tp2_sp_fp32's (cached)."""
    with harness.extra_feature_module("broken_swap_attention_feature"):
        result = harness.compare(["--use-test-swap-attention-other-layer"], layout="tp2-sp",
                                 extra_args=[*MODEL, *precision], iters=4)
    assert not result.passed
    assert result.grads.failures, "the wrong tensors reach the gradients"
