"""The fused-op features patch what they say (and validate their preconditions)."""

import argparse

import pytest
import torch

import mm_adaptor
from mm_adaptor.features import FeatureConfigError


@pytest.fixture
def cpu_backend():
    yield
    mm_adaptor.disable()


def tiny_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(num_layers=1, hidden_size=16, num_attention_heads=2, normalization="RMSNorm",
                  gated_linear_unit=True, activation_func=torch.nn.functional.silu, use_cpu_initialization=True,
                  bias_activation_fusion=False, apply_rope_fusion=False)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def test_fused_rmsnorm_builds_the_native_module(cpu_backend):
    mm_adaptor.enable(argparse.Namespace(use_fused_rmsnorm=True, normalization="RMSNorm"))
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from mm_adaptor.patches.transformer.fused_ops import FusedRMSNorm

    norm = WrappedTorchNorm(tiny_config(), 16, eps=1e-6)
    assert isinstance(norm, FusedRMSNorm) and norm.eps == 1e-6
    assert list(dict(norm.named_parameters())) == ["weight"]  # checkpoints match torch.nn.RMSNorm
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (16,), norm.weight, 1e-6))
    layer_norm = WrappedTorchNorm(tiny_config(normalization="LayerNorm"), 16)
    assert isinstance(layer_norm, torch.nn.LayerNorm), "LayerNorm models keep torch's LayerNorm"


def test_fused_swiglu_runs_the_native_op(cpu_backend, monkeypatch):
    from mm_adaptor import ops
    from mm_adaptor.patches.transformer import fused_ops

    calls = []
    native = ops.swiglu
    monkeypatch.setattr(fused_ops.ops, "swiglu", lambda x: calls.append(x.shape) or native(x))
    mm_adaptor.enable(argparse.Namespace(use_fused_swiglu=True, swiglu=True))
    from megatron.core.transformer.mlp import MLP

    assert hasattr(MLP.forward, "__wrapped__")
    fake = type("FakeMLP", (), {})()
    fake.config = tiny_config()
    fake.activation_func = torch.nn.functional.silu
    fake.linear_fc1 = lambda h: (torch.cat([h, h], -1), None)
    fake.linear_fc2 = lambda h: (h, None)
    out, bias = MLP.forward(fake, torch.randn(2, 3, 4))
    assert calls == [torch.Size([2, 3, 8])] and out.shape == (2, 3, 4) and bias is None


def test_fused_rope_runs_native_op_and_falls_back_for_packed_sequences(cpu_backend):
    from megatron.core.models.common.embeddings import rope_utils

    t = torch.randn(5, 2, 2, 8)
    base = torch.randn(5, 1, 1, 4)
    freqs = torch.cat([base, base], -1)
    config = tiny_config()
    single_rank = type("Group", (), {"size": lambda self: 1, "rank": lambda self: 0})()
    expected = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False)
    mm_adaptor.enable(argparse.Namespace(use_fused_rotary_pos_emb=True, position_embedding_type="rope"))
    torch.testing.assert_close(rope_utils.apply_rotary_pos_emb(t, freqs, config, cp_group=single_rank), expected)
    with pytest.warns(RuntimeWarning, match="packed sequences"):
        rope_utils.apply_rotary_pos_emb(t.reshape(10, 2, 8), freqs, config,
                                        cu_seqlens=torch.tensor([0, 5, 10]), cp_group=single_rank)


@pytest.mark.parametrize("options, message", [
    (dict(use_fused_rmsnorm=True, normalization="LayerNorm"), "--use-fused-rmsnorm needs --normalization RMSNorm"),
    (dict(use_fused_rmsnorm=True, normalization="RMSNorm", transformer_impl="transformer_engine"),
     "--transformer-impl local"),
    (dict(use_fused_swiglu=True, swiglu=False), "--use-fused-swiglu needs --swiglu"),
    (dict(use_fused_rotary_pos_emb=True, position_embedding_type="learned_absolute"),
     "--position-embedding-type rope"),
    (dict(use_flash_attn=True, attention_dropout=0.1), "--attention-dropout 0"),
])
def test_preconditions_are_named(cpu_backend, options, message):
    with pytest.raises(FeatureConfigError, match=message):
        mm_adaptor.enable(argparse.Namespace(**options))
    assert mm_adaptor.applied() == {}
