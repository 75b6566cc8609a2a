"""Compatibility patches for megatron-core without Transformer Engine / Apex: Megatron-LM's default rope fusion
and persist_layer_norm are served instead of refused; each patch is listed, contract-checked and reverted."""

import pytest
import torch

from mm_adaptor import devices
from mm_adaptor.core.patching import PatchContractError
from mm_adaptor.devices import megatron_compat


@pytest.fixture
def backend():
    assert devices.current() is None
    yield devices.install("cpu")
    devices.uninstall()


def config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def rope_inputs(dtype=torch.float32, rotary=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    s, b, h, d = 7, 3, 2, 16  # partial rotary: 12 of 16 channels, odd sequence length
    t = torch.randn(s, b, h, d, generator=generator, dtype=torch.float32).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # megatron's [s, 1, 1, rot]
    return t, freqs


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_fusion_matches_megatrons_unfused_rope_forward_and_backward(backend, interleaved):
    from megatron.core.models.common.embeddings import rope_utils

    assert rope_utils.fused_apply_rotary_pos_emb is megatron_compat.fused_apply_rotary_pos_emb
    t, freqs = rope_inputs()
    grad = torch.randn(t.shape, generator=torch.Generator().manual_seed(1))
    fused_in = t.clone().requires_grad_()
    fused = rope_utils.fused_apply_rotary_pos_emb(fused_in, freqs, interleaved=interleaved)
    fused.backward(grad)
    plain_in = t.clone().requires_grad_()
    plain = rope_utils._apply_rotary_pos_emb_bshd(plain_in, freqs, rotary_interleaved=interleaved)
    plain.backward(grad)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_in.grad, plain_in.grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(fused[..., 12:], t[..., 12:])  # channels past the rotary dim pass through


def test_megatron_lm_default_rope_fusion_builds_and_runs_the_native_kernel(single_rank_megatron):
    from megatron.core.models.common.embeddings import rope_utils

    cfg = config(apply_rope_fusion=True)  # unpatched without TE: ValueError, apply_rope_fusion is not available
    t, freqs = rope_inputs()
    expected = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
    torch.testing.assert_close(rope_utils.apply_rotary_pos_emb(t, freqs, cfg), expected, rtol=1e-6, atol=1e-6)


def test_rope_fusion_is_reverted_with_the_backend():
    from megatron.core.models.common.embeddings import rope_utils

    devices.install("cpu")
    devices.uninstall()
    assert rope_utils.fused_apply_rotary_pos_emb is None
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        config(apply_rope_fusion=True)


def test_rope_fusion_never_replaces_an_existing_kernel(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    assert devices.current() is None
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda t, freqs, **kw: t)
    with pytest.raises(PatchContractError, match="fused_apply_rotary_pos_emb"):
        megatron_compat.rope_fusion_patches().apply()


@pytest.mark.parametrize("normalization, expected", [("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)])
def test_persist_layer_norm_builds_the_torch_norm(backend, normalization, expected):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = config(normalization=normalization, persist_layer_norm=True)  # Megatron-LM's default
    norm = WrappedTorchNorm(cfg, 16, eps=1e-5)
    assert type(norm) is expected and norm.normalized_shape == (16,)
    assert cfg.persist_layer_norm is True and not hasattr(norm.weight, "sequence_parallel")
    cfg.sequence_parallel = True  # as under --sequence-parallel with TP > 1
    norm = WrappedTorchNorm(cfg, 16, eps=1e-5)
    assert all(p.sequence_parallel for p in norm.parameters())
    assert cfg.sequence_parallel is True and cfg.persist_layer_norm is True


def test_persist_layer_norm_is_refused_again_after_uninstall():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    devices.install("cpu")
    devices.uninstall()
    with pytest.raises(AssertionError, match="persist_layer_norm not supported"):
        WrappedTorchNorm(config(persist_layer_norm=True), 16)


def test_every_compat_set_says_what_it_changes_and_what_megatron_does_without_it():
    for patch_set in megatron_compat.every_device_patch_sets():
        assert patch_set.name.startswith("compat:")
        assert patch_set.changes and patch_set.unpatched and patch_set.needed_on, patch_set.name
        assert bool(patch_set.not_needed) != bool(len(patch_set)), patch_set.name
        for patch in patch_set:
            assert getattr(patch, "contract", True) is not None, f"{patch.target} has no contract"


def test_report_has_a_section_per_patch_set():
    from mm_adaptor.cli.report import report_lines

    text = "\n".join(report_lines())
    for name in ("device:cpu", "compat:rope-fusion", "compat:torch-norm", "compat:torch-adam-distributed-checkpoint"):
        assert f"  {name}:" in text
    assert "apply_rope_fusion is not available" in text and "persist_layer_norm not supported" in text
