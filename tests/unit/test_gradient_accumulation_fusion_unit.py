"""With the adaptor installed, megatron's ColumnParallelLinear accepts gradient_accumulation_fusion without Apex
and its backward accumulates the weight gradient into main_grad through the native op."""

import torch

from mm_adaptor import devices


def test_fused_wgrad_accumulates_into_main_grad(single_rank_megatron, monkeypatch):
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    import mm_adaptor.ops.wgrad as wgrad

    calls = []
    native = wgrad.wgrad_gemm_accum_fp32
    monkeypatch.setattr(wgrad, "wgrad_gemm_accum_fp32", lambda *a: calls.append(1) or native(*a))
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                               gradient_accumulation_fusion=True)
    layer = ColumnParallelLinear(8, 6, config=config, init_method=torch.nn.init.normal_, bias=False)
    start = torch.randn(6, 8)
    layer.weight.main_grad = start.clone()
    x = torch.randn(5, 1, 8, requires_grad=True)
    out, _ = layer(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert calls == [1], "the backward must go through the adaptor's fused weight-gradient path"
    expected = start + grad.reshape(-1, 6).t() @ x.detach().reshape(-1, 8)
    torch.testing.assert_close(layer.weight.main_grad, expected)


def test_uninstall_removes_the_extension_module():
    import sys

    devices.install("cpu")
    assert "fused_weight_gradient_mlp_cuda" in sys.modules
    devices.uninstall()
    assert "fused_weight_gradient_mlp_cuda" not in sys.modules
    import megatron.core.tensor_parallel.layers as layers

    assert layers._grad_accum_fusion_available is False
