"""The fused-op features patch what they say (and validate their preconditions)."""

import argparse
import functools

import pytest
import torch
from megatron_releases import requires_grouped_mlp

import mm_adaptor
from mm_adaptor.core.features import FeatureConfigError

pytestmark = pytest.mark.usefixtures("megatron_fusions_eager")


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
])
def test_preconditions_are_named(cpu_backend, options, message):
    with pytest.raises(FeatureConfigError, match=message):
        mm_adaptor.enable(argparse.Namespace(**options))
    assert mm_adaptor.applied_features() == {}


@pytest.mark.parametrize("options, message", [
    (dict(use_fused_gmm=True, num_experts=None, moe_grouped_gemm=True), "add --num-experts"),
    (dict(use_fused_gmm=True, num_experts=4, moe_grouped_gemm=False), "add --moe-grouped-gemm"),
    (dict(use_fused_gmm=True, num_experts=4, moe_grouped_gemm=True, add_bias_linear=True), "--disable-bias-linear"),
    (dict(use_fused_gmm=True, num_experts=4, moe_grouped_gemm=True, disable_bias_linear=False),
     "--disable-bias-linear"),
])
def test_fused_gmm_preconditions_are_named(cpu_backend, options, message):
    with pytest.raises(FeatureConfigError, match=message):
        mm_adaptor.enable(argparse.Namespace(**options))
    assert mm_adaptor.applied_features() == {}


@pytest.mark.parametrize("trans_b", [False, True])
def test_gmm_keeps_the_grouped_gemm_package_signature(trans_b):
    from mm_adaptor.patches.transformer.moe_grouped_gemm import gmm

    sizes = torch.tensor([3, 0, 2])
    a, b = torch.randn(5, 4), torch.randn(3, 6, 4) if trans_b else torch.randn(3, 4, 6)
    rows = torch.repeat_interleave(torch.arange(3), sizes)
    expected = torch.stack([a[i] @ (b[e].t() if trans_b else b[e]) for i, e in enumerate(rows.tolist())])
    torch.testing.assert_close(gmm(a, b, sizes, trans_b=trans_b), expected)


def single_rank_experts():
    one = type("Group", (), {"size": lambda self: 1, "rank": lambda self: 0})()
    return type("PgCollection", (), {"ep": one, "expt_tp": one, "expt_dp": one})()


@requires_grouped_mlp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mlp_runs_on_the_native_op_in_any_dtype(cpu_backend, dtype):
    from megatron.core.transformer.moe.experts import GroupedMLP

    config = tiny_config(num_moe_experts=3, moe_ffn_hidden_size=8, add_bias_linear=False, params_dtype=dtype,
                         bf16=dtype == torch.bfloat16)
    with pytest.raises(AssertionError, match="Grouped GEMM is not available"):
        GroupedMLP(3, config, pg_collection=single_rank_experts())
    mm_adaptor.enable(argparse.Namespace(use_fused_gmm=True, num_experts=3, moe_grouped_gemm=True,
                                         disable_bias_linear=True))
    experts = GroupedMLP(3, config, pg_collection=single_rank_experts())
    sizes = torch.tensor([2, 0, 3])
    x = torch.randn(5, 16, dtype=dtype, requires_grad=True)
    probs = torch.rand(5, dtype=dtype)
    out, bias = experts(x, sizes, probs)
    assert bias is None and out.dtype == dtype
    w1, w2 = experts.weight1.view(3, 16, 16), experts.weight2.view(3, 8, 16)
    rows = torch.repeat_interleave(torch.arange(3), sizes).tolist()
    expected = []
    for i, e in enumerate(rows):
        gate, up = (x[i].float() @ w1[e].float()).chunk(2)
        expected.append((torch.nn.functional.silu(gate) * up * probs[i].float()) @ w2[e].float())
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float(), torch.stack(expected), **tol)
    out.float().sum().backward()
    assert experts.weight1.grad.view(3, 16, 16)[1].abs().sum() == 0, "an expert without tokens gets zero gradients"
    assert experts.weight1.grad.view(3, 16, 16)[0].abs().sum() > 0


@requires_grouped_mlp
def test_dump_names_grouped_experts_like_sequential_ones(cpu_backend):
    """The harness compares GroupedMLP with SequentialMLP through these views: F.linear with the viewed
    per-expert weights must reproduce GroupedMLP's output."""
    from megatron.core.transformer.moe.experts import GroupedMLP

    from mm_adaptor.harness.runner import dump_entries

    mm_adaptor.enable(argparse.Namespace(use_fused_gmm=True, num_experts=2, moe_grouped_gemm=True,
                                         disable_bias_linear=True))
    config = tiny_config(num_moe_experts=2, moe_ffn_hidden_size=8, add_bias_linear=False)
    experts = GroupedMLP(2, config, pg_collection=single_rank_experts())
    views = {name: view(p.detach()) for name, p, view in dump_entries(experts)}
    assert sorted(views) == [f"local_experts.{e}.linear_fc{i}.weight" for e in (0, 1) for i in (1, 2)]
    assert views["local_experts.0.linear_fc1.weight"].shape == (16, 16)  # [2 x ffn, hidden], like ColumnParallel
    assert views["local_experts.0.linear_fc2.weight"].shape == (16, 8)
    x, sizes, probs = torch.randn(4, 16), torch.tensor([1, 3]), torch.ones(4)
    out, _ = experts(x, sizes, probs)
    F = torch.nn.functional
    for e, rows in enumerate(torch.split(torch.arange(4), sizes.tolist())):
        gate, up = F.linear(x[rows], views[f"local_experts.{e}.linear_fc1.weight"]).chunk(2, -1)
        torch.testing.assert_close(out[rows], F.linear(F.silu(gate) * up,
                                                       views[f"local_experts.{e}.linear_fc2.weight"]))


def submodules_of(spec):
    """A ModuleSpec's submodules; megatron-core 0.19's specs are functools.partial(cls, submodules=...)."""
    return spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules


def sequential_experts(config, experts):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import SequentialMLP

    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False)
    return SequentialMLP(experts, config, submodules_of(submodules_of(submodules_of(spec).mlp).experts),
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def expert_reference(experts, x, sizes, probs):
    """SequentialMLP's math written out: per expert, (silu(gate) * up * prob) @ fc2 (+ fc2 bias * prob), products
    with the (fp32) probabilities cast back to the model's dtype."""
    F = torch.nn.functional
    outputs = []
    for expert, rows in zip(experts.local_experts, torch.split(torch.arange(len(x)), sizes.tolist())):
        fc1, fc2 = expert.linear_fc1, expert.linear_fc2
        gate, up = F.linear(x[rows], fc1.weight, fc1.bias).chunk(2, -1)
        scale = probs[rows].unsqueeze(-1)
        out = F.linear((F.silu(gate) * up * scale).to(x.dtype), fc2.weight)
        outputs.append(out if fc2.bias is None else (out + fc2.bias * scale).to(x.dtype))
    return torch.cat(outputs)


def output_and_grads(fn, module, probs):
    module.zero_grad()
    probs.grad = None
    out = fn()
    out.sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in module.named_parameters()}, probs.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_fused_swiglu_reaches_sequential_experts(single_rank_megatron, cpu_backend, monkeypatch, bias, dtype):
    """Experts get routing probabilities (per_token_scale): the fused path scales as megatron's unfused one does.
    Megatron's own expert path cannot be the reference with a bias on one rank (TP1, EP1): it adds the scaled bias
    in place to the row-parallel output, there a view that autograd refuses to modify."""
    from mm_adaptor import ops
    from mm_adaptor.patches.transformer import fused_ops

    config = tiny_config(num_moe_experts=2, moe_ffn_hidden_size=8, add_bias_linear=bias, params_dtype=dtype,
                         bf16=dtype == torch.bfloat16)
    x = torch.randn(5, 16, dtype=dtype)
    sizes, probs = torch.tensor([3, 2]), torch.rand(5, requires_grad=True)  # the router's probabilities are fp32
    torch.manual_seed(0)
    unpatched = sequential_experts(config, 2)
    if not bias:
        megatron = output_and_grads(lambda: unpatched(x, sizes, probs)[0], unpatched, probs)

    calls = []
    native = ops.swiglu
    monkeypatch.setattr(fused_ops.ops, "swiglu", lambda t: calls.append(t.shape) or native(t))
    mm_adaptor.enable(argparse.Namespace(use_fused_swiglu=True, swiglu=True))
    fused = sequential_experts(config, 2)
    fused.load_state_dict(unpatched.state_dict())
    out, out_bias = fused(x, sizes, probs)
    assert calls == [torch.Size([3, 16]), torch.Size([2, 16])], "each expert's SwiGLU runs the native op"
    assert out_bias is None, "an expert adds its scaled bias itself"
    assert out.dtype == dtype, "the expert's output keeps the model's dtype"
    got = output_and_grads(lambda: fused(x, sizes, probs)[0], fused, probs)
    references = [output_and_grads(lambda: expert_reference(fused, x, sizes, probs), fused, probs)]
    if not bias:
        references.append(megatron)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    for reference in references:
        torch.testing.assert_close(got[0], reference[0], **tol)
        for name in got[1]:
            torch.testing.assert_close(got[1][name], reference[1][name], msg=name, **tol)
        torch.testing.assert_close(got[2], reference[2], **tol)


@requires_grouped_mlp
def test_fused_swiglu_reaches_grouped_experts(cpu_backend):
    from megatron.core.transformer.moe.experts import GroupedMLP

    from mm_adaptor import ops

    mm_adaptor.enable(argparse.Namespace(use_fused_gmm=True, num_experts=2, moe_grouped_gemm=True,
                                         disable_bias_linear=True, use_fused_swiglu=True, swiglu=True))
    config = tiny_config(num_moe_experts=2, moe_ffn_hidden_size=8, add_bias_linear=False)
    experts = GroupedMLP(2, config, pg_collection=single_rank_experts())
    assert experts.activation_func is ops.swiglu
    x, sizes, probs = torch.randn(4, 16), torch.tensor([1, 3]), torch.rand(4)
    F = torch.nn.functional
    w1, w2 = experts.weight1.view(2, 16, 16), experts.weight2.view(2, 8, 16)
    rows = torch.repeat_interleave(torch.arange(2), sizes).tolist()
    expected = torch.stack([(F.silu((x[i] @ w1[e])[:8]) * (x[i] @ w1[e])[8:] * probs[i]) @ w2[e]
                            for i, e in enumerate(rows)])
    torch.testing.assert_close(experts(x, sizes, probs)[0], expected)
    geglu = GroupedMLP(2, tiny_config(num_moe_experts=2, moe_ffn_hidden_size=8, add_bias_linear=False,
                                      activation_func=F.gelu), pg_collection=single_rank_experts())
    assert geglu.activation_func is not ops.swiglu, "other gated activations keep megatron's code"
