"""Every configuration megatron 0.16.1's replaced modules handle: the fused features honour it (our result equals
megatron's), fall back to megatron's code (one warning), refuse it where megatron refuses it too, or, for the
Megatron-owned --use-flash-attn, stand aside."""

import argparse
import warnings

import pytest
import torch
import torch.nn.functional as F

import mm_adaptor
from mm_adaptor.core import features
from mm_adaptor.core.features import Feature, FeatureConfigError, Flag
from mm_adaptor.patches.transformer import fused_ops

from gloo_rank import one_gloo_rank
from megatron_releases import requires_grouped_mlp


pytestmark = pytest.mark.usefixtures("megatron_fusions_eager")


@pytest.fixture(scope="module", autouse=True)
def single_rank_megatron_module():
    """conftest's single_rank_megatron once for this module: installing the CPU backend costs seconds."""
    with one_gloo_rank():
        yield


@pytest.fixture
def adaptor(monkeypatch):
    monkeypatch.setattr(fused_ops, "_warned", set())
    monkeypatch.setattr(features, "_stood_aside", set())
    yield
    mm_adaptor.disable(keep_device=True)


@pytest.fixture
def megatron_rng():
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def enable(**options):
    return mm_adaptor.enable(argparse.Namespace(**options))


def config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(num_layers=2, hidden_size=32, num_attention_heads=4, normalization="RMSNorm", gated_linear_unit=True,
                  activation_func=F.silu, use_cpu_initialization=True, bias_activation_fusion=False,
                  apply_rope_fusion=False, attention_dropout=0.0, hidden_dropout=0.0)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def fallback_warnings(record):
    return [str(w.message) for w in record if "megatron's own code runs" in str(w.message)]


def output_and_grads(fn, inputs, params=()):
    for t in (*inputs, *params):
        t.grad = None
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    gen = torch.Generator().manual_seed(99)
    out.backward(torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype))
    return out.detach().clone(), [None if t.grad is None else t.grad.clone() for t in (*inputs, *params)]


def assert_same(got, want, exact=False, **tol):
    if exact:
        tol = dict(rtol=0, atol=0)
    torch.testing.assert_close(got[0], want[0], **tol)
    assert [g is None for g in got[1]] == [w is None for w in want[1]]
    for g, w in zip(got[1], want[1]):
        if g is not None:
            torch.testing.assert_close(g, w, **tol)


# ------------------------------------------------------------------ Megatron-owned flags stand aside


class FakeOwned(Feature):
    name = "fake-owned"
    description = "a feature attached to a Megatron-owned flag, for tests"
    flags = (Flag("--use-fake-owned", description, megatron_owned=True),)
    applied_with = []

    def stands_aside(self, options):
        return None if options.fake_impl == "ours" else f"--fake-impl {options.fake_impl} serves it"

    def validate(self, options):
        if options.fake_impl != "ours":
            raise AssertionError("validate must not run for a feature standing aside")

    def patch_sets(self, options):
        self.applied_with.append(options.fake_impl)
        return []


class FakeOwn(FakeOwned):
    name = "fake-own"
    flags = (Flag("--use-fake-own", "our own flag: stands_aside is not consulted"),)

    def validate(self, options):
        pass


@pytest.fixture
def fake_features():
    features.register(FakeOwned)
    features.register(FakeOwn)
    FakeOwned.applied_with = []
    yield
    features.unregister("fake-owned")
    features.unregister("fake-own")


def test_a_megatron_owned_feature_stands_aside_with_one_warning(adaptor, fake_features):
    with pytest.warns(RuntimeWarning) as record:
        for _ in range(2):
            active = mm_adaptor.enable(argparse.Namespace(use_fake_owned=True, fake_impl="theirs"))
            assert "fake-owned" not in active
            mm_adaptor.disable(keep_device=True)
    messages = [str(w.message) for w in record if "--use-fake-owned" in str(w.message)]
    assert messages == ["mm_adaptor leaves --use-fake-owned to Megatron: --fake-impl theirs serves it; "
                        "Megatron's own --use-fake-owned behaviour stays"], "one warning per process"
    assert FakeOwned.applied_with == []
    assert "fake-owned" in mm_adaptor.enable(argparse.Namespace(use_fake_owned=True, fake_impl="ours"))
    assert FakeOwned.applied_with == ["ours"]


def test_stands_aside_is_consulted_only_for_megatron_owned_flags(adaptor, fake_features):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "fake-own" in mm_adaptor.enable(argparse.Namespace(use_fake_own=True, fake_impl="theirs"))


def test_flash_attn_stands_aside_for_transformer_engine(adaptor):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    with pytest.warns(RuntimeWarning, match="leaves --use-flash-attn to Megatron: --transformer-impl "
                                            "transformer_engine builds Transformer Engine's attention"):
        active = mm_adaptor.enable(argparse.Namespace(use_flash_attn=True, transformer_impl="transformer_engine",
                                                      attention_dropout=0.1))
    assert "flash-attn" not in active
    assert not hasattr(DotProductAttention.forward, "__wrapped__")


@pytest.mark.parametrize("options", [
    dict(attention_dropout=0.1), dict(transformer_impl="transformer_engine"), dict(transformer_impl="local"),
    dict(attention_dropout=0.0, sequence_parallel=True, context_parallel_size=2),
    dict(transformer_impl="inference_optimized", attention_dropout=0.3),
])
def test_flash_attn_validate_never_refuses(options):
    features.get("flash-attn").validate(argparse.Namespace(use_flash_attn=True, **options))


# ------------------------------------------------------------------ --use-flash-attn: DotProductAttention


def attention(cfg, mask_type="causal", layer_number=1, **kwargs):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    return DotProductAttention(cfg, layer_number=layer_number, attn_mask_type=getattr(AttnMaskType, mask_type),
                               attention_type="self", **kwargs)


def qkv(cfg, sq=7, sk=None, b=2, dtype=torch.float32):
    gen = torch.Generator().manual_seed(sq)
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads, cfg.kv_channels
    shapes = ((sq, b, heads, d), (sk or sq, b, groups, d), (sk or sq, b, groups, d))
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def padding_mask(b, sq, sk):
    mask = torch.zeros(b, 1, sq, sk, dtype=torch.bool)
    mask[1, :, :, -2:] = True  # padded keys
    mask[0, :, 3, :] = True  # a fully masked row: megatron's -10000 fill makes it uniform
    return mask


def random_mask(b, sq, sk):
    mask = torch.rand(b, 1, sq, sk, generator=torch.Generator().manual_seed(1)) < 0.4
    mask[0, :, 2, :] = True
    return mask


def run_attention(attn, q, k, v, mask, **kwargs):
    return output_and_grads(lambda q, k, v: attn(q, k, v, mask, **kwargs), [q, k, v], list(attn.parameters()))


ATTENTION_CASES = {  # config overrides, module kwargs, mask builder, sq, sk, dtype
    "causal": (dict(), dict(), None, 7, 7, torch.float32),
    "causal-type-with-padding-mask": (dict(), dict(), padding_mask, 7, 7, torch.float32),
    "padding": (dict(), dict(mask_type="padding"), padding_mask, 7, 7, torch.float32),
    "padding-cross-lengths": (dict(), dict(mask_type="padding"), padding_mask, 5, 9, torch.float32),
    "no-mask": (dict(), dict(mask_type="no_mask"), None, 7, 7, torch.float32),
    "padding-causal-without-mask": (dict(), dict(mask_type="padding_causal"), None, 7, 7, torch.float32),
    "arbitrary": (dict(), dict(mask_type="arbitrary"), random_mask, 7, 7, torch.float32),
    "gqa": (dict(num_query_groups=2), dict(), None, 7, 7, torch.float32),
    "sliding-window": (dict(window_size=(2, 0)), dict(), None, 9, 9, torch.float32),
    "sliding-window-replaces-mask": (dict(window_size=(3, 0)), dict(mask_type="padding"), padding_mask, 9, 9,
                                     torch.float32),
    "sliding-window-skipped-layer": (dict(window_size=(2, 0), window_attn_skip_freq=2), dict(layer_number=2), None,
                                     9, 9, torch.float32),
    "qk-layer-scaling": (dict(apply_query_key_layer_scaling=True), dict(layer_number=3), None, 7, 7, torch.float32),
    "explicit-softmax-scale": (dict(), dict(softmax_scale=0.05), None, 7, 7, torch.float32),
    "bf16-softmax-in-bf16": (dict(bf16=True, params_dtype=torch.bfloat16, attention_softmax_in_fp32=False), dict(),
                             None, 7, 7, torch.bfloat16),
    "bf16-softmax-in-fp32": (dict(bf16=True, params_dtype=torch.bfloat16), dict(), padding_mask, 7, 7,
                             torch.bfloat16),
}


@pytest.mark.parametrize("case", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_flash_attention_honours_what_megatron_computes(megatron_rng, adaptor, monkeypatch, case):
    overrides, kwargs, make_mask, sq, sk, dtype = case
    cfg = config(**overrides)
    attn = attention(cfg, **kwargs)
    q, k, v = qkv(cfg, sq, sk, dtype=dtype)
    mask = make_mask(2, sq, sk) if make_mask else None
    megatron = run_attention(attn, q, k, v, mask)

    calls = []
    native = fused_ops.ops.flash_attention
    monkeypatch.setattr(fused_ops.ops, "flash_attention", lambda *a, **kw: calls.append(kw) or native(*a, **kw))
    enable(use_flash_attn=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ours = run_attention(attn, q, k, v, mask)
    assert len(calls) == 1, "the native path ran"
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    assert_same(ours, megatron, **tol)


FALLBACK_CASES = {  # config overrides, call kwargs, expected warning
    "softmax-off-by-one": (dict(softmax_type="off-by-one"), dict(), "softmax offset"),
    "softmax-learnable": (dict(softmax_type="learnable"), dict(), "softmax offset"),
}


@pytest.mark.parametrize("case", FALLBACK_CASES.values(), ids=FALLBACK_CASES.keys())
def test_flash_attention_falls_back_to_megatron(megatron_rng, adaptor, case):
    overrides, call_kwargs, warning = case
    cfg = config(**overrides)
    attn = attention(cfg)
    q, k, v = qkv(cfg)
    megatron = run_attention(attn, q, k, v, None, **call_kwargs)
    enable(use_flash_attn=True)
    with pytest.warns(RuntimeWarning, match=warning) as record:
        ours = run_attention(attn, q, k, v, None, **call_kwargs)
        run_attention(attn, q, k, v, None, **call_kwargs)
    assert len(fallback_warnings(record)) == 1, "one warning"
    assert_same(ours, megatron, exact=True)


@pytest.mark.parametrize("what", ["packed_seq_params", "attention_bias", "causal_cross_lengths"])
def test_flash_attention_leaves_megatrons_refusals_to_megatron(megatron_rng, adaptor, what):
    cfg = config()
    attn = attention(cfg)
    q, k, v = qkv(cfg, 5, 7 if what == "causal_cross_lengths" else 5)
    kwargs = {"packed_seq_params": dict(packed_seq_params=object()),
              "attention_bias": dict(attention_bias=torch.zeros(1)), "causal_cross_lengths": {}}[what]
    with pytest.raises(AssertionError) as unpatched:
        attn(q, k, v, None, **kwargs)
    enable(use_flash_attn=True)
    with pytest.raises(AssertionError) as patched, warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        attn(q, k, v, None, **kwargs)
    assert str(patched.value) == str(unpatched.value)
    assert len(fallback_warnings(record)) == 1


def test_flash_attention_leaves_context_parallelism_to_megatrons_refusal(megatron_rng, adaptor):
    enable(use_flash_attn=True)
    with pytest.raises(AssertionError, match="Context parallelism is only supported by TEDotProductAttention"):
        attention(config(context_parallel_size=2))


def test_flash_attention_without_dropout_in_eval_and_with_the_modules_own_probability(megatron_rng, adaptor):
    """Dropout only in training, with the module's probability (an explicit attention_dropout wins over config)."""
    cfg = config(attention_dropout=0.3)
    explicit_zero = attention(cfg, attention_dropout=0.0)
    explicit_half = attention(config(attention_dropout=0.0), attention_dropout=0.5)
    q, k, v = qkv(cfg)
    expected = [run_attention(m, q, k, v, None) for m in (explicit_zero, explicit_half.eval())]
    enable(use_flash_attn=True)
    assert_same(run_attention(explicit_zero, q, k, v, None), expected[0], rtol=1e-5, atol=1e-5)
    assert_same(run_attention(explicit_half, q, k, v, None), expected[1], rtol=1e-5, atol=1e-5)  # eval
    dropped = run_attention(explicit_half.train(), q, k, v, None)
    assert not torch.allclose(dropped[0], expected[1][0]), "training applies the module's dropout"


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tracker-fork", "sequence-parallel"])
def test_flash_attention_draws_dropout_where_megatron_does(megatron_rng, adaptor, sequence_parallel):
    """Megatron draws attention dropout inside the RNG tracker's fork unless sequence parallel: the same generator
    (and only that one) advances with the patch."""
    from megatron.core import tensor_parallel

    cfg = config(attention_dropout=0.2)
    cfg.sequence_parallel = sequence_parallel  # the module reads only this (a config refuses SP without TP)
    attn = attention(cfg)
    q, k, v = qkv(cfg)
    tracker = tensor_parallel.get_cuda_rng_tracker()

    def advanced():
        default, forked = torch.get_rng_state(), tracker.get_states()["model-parallel-rng"].clone()
        attn(q, k, v, None)
        return (not torch.equal(default, torch.get_rng_state()),
                not torch.equal(forked, tracker.get_states()["model-parallel-rng"]))

    megatron = advanced()
    assert megatron == (sequence_parallel, not sequence_parallel)
    enable(use_flash_attn=True)
    assert advanced() == megatron


@pytest.mark.parametrize("mask_type", ["causal", "padding"])
def test_flash_attention_dropout_is_reproduced_by_activation_recompute(megatron_rng, adaptor, monkeypatch, mask_type):
    """A forward+backward under megatron's checkpoint (the RNG states restored for recompute) is bit-identical to the
    same forward+backward without recompute."""
    from megatron.core import tensor_parallel

    calls = []
    native = fused_ops.ops.flash_attention
    monkeypatch.setattr(fused_ops.ops, "flash_attention", lambda *a, **kw: calls.append(kw) or native(*a, **kw))
    enable(use_flash_attn=True)
    cfg = config(attention_dropout=0.25, num_query_groups=2)
    attn = attention(cfg, mask_type=mask_type)
    q, k, v = qkv(cfg, sq=11)
    mask = padding_mask(2, 11, 11) if mask_type == "padding" else None

    def run(recompute, seed=77):
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        if recompute:
            return output_and_grads(lambda *t: tensor_parallel.checkpoint(attn, False, *t, mask), [q, k, v])
        return output_and_grads(lambda *t: attn(*t, mask), [q, k, v])

    plain, recomputed = run(False), run(True)
    assert [c["dropout_p"] for c in calls] == [0.25] * 3, "forward, checkpointed forward, recompute"
    assert_same(recomputed, plain, exact=True)
    assert not torch.equal(run(False, seed=78)[0], plain[0]), "another seed, another mask"


# ------------------------------------------------------------------ --use-fused-rmsnorm: WrappedTorchNorm


def rms_reference(x, weight, eps, centred):
    xf, wf = x.double(), weight.double()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * ((1 + wf) if centred else wf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_rmsnorm_honours_zero_centred_gamma(adaptor, dtype):
    """--apply-layernorm-1p: weight initialised to zeros, y = x_hat * (1 + w) (Transformer Engine's and Apex's
    meaning; megatron's torch norm refuses it). 1 + w in fp32, so a small bf16 weight is not rounded away."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = config(layernorm_zero_centered_gamma=True, params_dtype=dtype)
    with pytest.raises(AssertionError, match="zero_centered_gamma"):
        WrappedTorchNorm(cfg, 16)
    enable(use_fused_rmsnorm=True, normalization="RMSNorm")
    norm = WrappedTorchNorm(cfg, 16, eps=1e-6)
    assert norm.weight.dtype == dtype and torch.equal(norm.weight, torch.zeros(16, dtype=dtype))
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16) * 1e-2)
    x = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    y = norm(x)
    expected = rms_reference(x.detach(), norm.weight.detach(), 1e-6, centred=True)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y.double(), expected, **tol)
    grad = torch.randn_like(y)
    y.backward(grad)
    x64, w64 = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    rms_reference(x64, w64, 1e-6, centred=True).backward(grad.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(norm.weight.grad.double(), w64.grad, **(tol if dtype == torch.float32 else
                                                                       dict(rtol=3e-2, atol=3e-2)))


def test_fused_rmsnorm_refuses_memory_efficient_layer_norm_like_megatron(adaptor):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = config(memory_efficient_layer_norm=True)
    with pytest.raises(AssertionError, match="memory_efficient_layer_norm"):
        WrappedTorchNorm(cfg, 16)
    with pytest.raises(FeatureConfigError, match="drop --memory-efficient-layer-norm"):
        enable(use_fused_rmsnorm=True, normalization="RMSNorm", memory_efficient_layer_norm=True)
    enable(use_fused_rmsnorm=True, normalization="RMSNorm")
    with pytest.raises(FeatureConfigError, match="--use-fused-rmsnorm does not implement --memory-efficient"):
        WrappedTorchNorm(cfg, 16)


def test_fused_rmsnorm_accepts_persist_layer_norm_and_sequence_parallel(adaptor):
    """persist_layer_norm only selects Apex's persistent LayerNorm kernel; sequence parallelism marks the weight."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    enable(use_fused_rmsnorm=True, normalization="RMSNorm")
    cfg = config(persist_layer_norm=True)
    cfg.sequence_parallel = True  # a config refuses SP without TP
    norm = WrappedTorchNorm(cfg, 16, 1e-4)
    x = torch.randn(4, 16)
    assert norm.eps == 1e-4 and norm.weight.sequence_parallel
    torch.testing.assert_close(norm(x), F.rms_norm(x, (16,), norm.weight, 1e-4))
    assert WrappedTorchNorm(config(), hidden_size=16).eps == 1e-5, "megatron's default eps"


def test_fused_rmsnorm_leaves_other_normalizations_to_megatron(adaptor):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    outcomes = []
    for patched in (False, True):
        if patched:
            enable(use_fused_rmsnorm=True, normalization="RMSNorm")
        try:
            outcomes.append(type(WrappedTorchNorm(config(normalization="L2Norm"), 16)))
        except Exception as exc:  # noqa: BLE001 (megatron 0.16.1 names a class torch lacks)
            outcomes.append(type(exc))
    assert outcomes[0] is outcomes[1]


# ------------------------------------------------------------------ --use-fused-swiglu: MLP.forward


class SwiGLUActivation(torch.nn.Module):
    """Stands in for Transformer Engine's activation module (use_te_activation_func)."""

    def __init__(self, config):
        super().__init__()

    def forward(self, x):
        a, b = x.chunk(2, -1)
        return F.silu(a) * b


def mlp(cfg, te_activation=False):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    torch.manual_seed(0)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear,
                               activation_func=SwiGLUActivation if te_activation else None)
    return MLP(cfg, submodules, ffn_hidden_size=cfg.ffn_hidden_size)


def run_mlp(module, x, scale):
    inputs = [x] + ([scale] if scale is not None else [])
    return output_and_grads(lambda x, *s: module(x, *s), inputs, list(module.parameters()))


SWIGLU_CASES = {  # config overrides, with routing-probability scale, native op expected, expected warning
    "fused-bias": (dict(bias_activation_fusion=True), False, True, None),
    "fused-weighted": (dict(bias_activation_fusion=True, add_bias_linear=False), True, True, None),
    "fused-ignores-clamp": (dict(bias_activation_fusion=True, activation_func_clamp_value=0.5), False, True, None),
    "unfused-weighted": (dict(add_bias_linear=False), True, True, None),
    "fp8-input-store-unfused-ignores-it": (dict(activation_func_fp8_input_store=True), False, True, None),
    "fused-fp8-input-store": (dict(bias_activation_fusion=True, activation_func_fp8_input_store=True), False, False,
                              "fp8-input-store"),
    "unfused-clamp": (dict(activation_func_clamp_value=0.5), False, False, "activation_func_clamp_value"),
    "unfused-glu-offset": (dict(glu_linear_offset=1.0), False, False, "glu_linear_offset"),
    "te-activation": (dict(use_te_activation_func=True), False, False, "use_te_activation_func"),
}


@pytest.mark.parametrize("case", SWIGLU_CASES.values(), ids=SWIGLU_CASES.keys())
def test_fused_swiglu_in_every_mlp_configuration(megatron_rng, adaptor, monkeypatch, case):
    overrides, scaled, native_expected, warning = case
    cfg = config(**overrides)
    module = mlp(cfg, te_activation=cfg.use_te_activation_func)
    x = torch.randn(6, 32, requires_grad=True)  # [tokens, hidden] as experts get them (megatron's fused weighted
    scale = torch.rand(6, requires_grad=True) if scaled else None  # SwiGLU takes only that layout with a scale)
    megatron = run_mlp(module, x, scale)

    calls = []
    native = fused_ops.ops.swiglu
    monkeypatch.setattr(fused_ops.ops, "swiglu", lambda t: calls.append(t.shape) or native(t))
    enable(use_fused_swiglu=True, swiglu=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ours = run_mlp(module, x, scale)
        run_mlp(module, x, scale)
    assert bool(calls) == native_expected
    found = fallback_warnings(record)
    if warning:
        assert len(found) == 1 and warning in found[0], found
        assert_same(ours, megatron, exact=True)
    else:
        assert not found, found
        assert_same(ours, megatron, rtol=1e-5, atol=1e-5)


def test_fused_swiglu_leaves_the_weighted_bias_refusal_to_megatron(megatron_rng, adaptor):
    module = mlp(config(bias_activation_fusion=True))
    x, scale = torch.randn(6, 32), torch.rand(6)
    with pytest.raises(NotImplementedError, match="Bias is not supported for weighted swiglu fusion"):
        module(x, scale)
    enable(use_fused_swiglu=True, swiglu=True)
    with pytest.raises(NotImplementedError, match="Bias is not supported"), warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        module(x, scale)
    assert len(fallback_warnings(rec)) == 1


def test_fused_swiglu_leaves_te_offloading_marks_to_megatron(monkeypatch):
    from megatron.core.transformer import mlp as megatron_mlp

    cfg = argparse.Namespace(use_te_activation_func=False, bias_activation_fusion=True, add_bias_linear=True,
                             activation_func_fp8_input_store=False, cpu_offloading=True,
                             cpu_offloading_activations=True)
    monkeypatch.setattr(megatron_mlp, "HAVE_TE", True)
    assert "offloading" in fused_ops._swiglu_needs_megatron(cfg, None)
    monkeypatch.setattr(megatron_mlp, "HAVE_TE", False)  # megatron passes cpu_offload_input=False then
    assert fused_ops._swiglu_needs_megatron(cfg, None) is None


# ------------------------------------------------------------------ --use-fused-gmm: GroupedMLP.forward


def experts_groups(tp_size=1):
    one = type("Group", (), {"size": lambda self: 1, "rank": lambda self: 0})()
    tp = type("Group", (), {"size": lambda self: tp_size, "rank": lambda self: 0})()
    return type("PgCollection", (), {"ep": one, "expt_tp": tp, "expt_dp": one})()


GROUPED_CASES = {  # config overrides, tokens per expert, expert TP size, fused swiglu too
    "plain": (dict(), [3, 0, 2], 1, False),
    "moe-act-recompute": (dict(recompute_granularity="selective", recompute_modules=["moe_act"]), [3, 0, 2], 1,
                          False),
    "moe-act-recompute-fused-swiglu": (dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
                                       [1, 2, 2], 1, True),
    "probs-on-input": (dict(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True),
                       [2, 2, 1], 1, False),
    "clamp-and-glu-offset-ignored": (dict(activation_func_clamp_value=0.3, glu_linear_offset=1.0), [2, 1, 2], 1,
                                     True),
    "no-tokens": (dict(), [0, 0, 0], 1, False),
    "no-tokens-recompute": (dict(recompute_granularity="selective", recompute_modules=["moe_act"]), [0, 0, 0], 1,
                            False),
    "expert-tp2": (dict(), [2, 1, 2], 2, True),
    "gelu-glu": (dict(activation_func=F.gelu), [2, 1, 2], 1, False),
}


@requires_grouped_mlp
@pytest.mark.parametrize("case", GROUPED_CASES.values(), ids=GROUPED_CASES.keys())
def test_grouped_mlp_forward_equals_megatrons_on_the_same_gemm(megatron_rng, adaptor, case):
    """Megatron's own GroupedMLP.forward (bf16, as it demands), run on the native grouped GEMM, against the
    replacement: bit for bit."""
    from megatron.core.transformer.moe.experts import GroupedMLP

    overrides, sizes, tp_size, fused_swiglu = case
    megatron_forward = GroupedMLP.forward
    enable(use_fused_gmm=True, num_experts=3, moe_grouped_gemm=True, disable_bias_linear=True,
                      use_fused_swiglu=fused_swiglu, swiglu=fused_swiglu)
    cfg = config(num_moe_experts=3, moe_ffn_hidden_size=8, add_bias_linear=False, bf16=True,
                 params_dtype=torch.bfloat16, moe_grouped_gemm=True, **overrides)
    experts = GroupedMLP(3, cfg, pg_collection=experts_groups(tp_size))
    assert (experts.activation_func is fused_ops.ops.swiglu) == (fused_swiglu and cfg.activation_func is F.silu)
    tokens = sum(sizes)
    x = torch.randn(tokens, 32, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens, dtype=torch.float32, requires_grad=True)
    counts = torch.tensor(sizes)
    params = list(experts.parameters())
    # megatron's moe_act recompute needs Transformer Engine (CheckpointWithoutOutput's default fp8=False reads as fp8
    # on): its forward without recompute is the reference, recompute changes no number
    recompute, experts.activation_recompute = experts.activation_recompute, False
    megatron = output_and_grads(lambda x, p: megatron_forward(experts, x, counts, p), [x, probs], params)
    experts.activation_recompute = recompute
    ours = output_and_grads(lambda x, p: experts(x, counts, p), [x, probs], params)
    assert_same(ours, megatron, exact=True)
    if recompute:
        assert experts.activation_checkpoint.ctx is None, "the activation was recomputed in backward"


@requires_grouped_mlp
def test_grouped_mlp_refuses_probs_on_input_with_top2_like_megatron(adaptor):
    with pytest.raises(FeatureConfigError, match="--moe-router-topk 1"):
        enable(use_fused_gmm=True, num_experts=3, moe_grouped_gemm=True, disable_bias_linear=True,
                          moe_apply_probs_on_input=True, moe_router_topk=2)
    from megatron.core.transformer.moe.experts import GroupedMLP

    enable(use_fused_gmm=True, num_experts=3, moe_grouped_gemm=True, disable_bias_linear=True)
    cfg = config(num_moe_experts=3, moe_ffn_hidden_size=8, add_bias_linear=False, moe_apply_probs_on_input=True,
                 moe_router_topk=2)
    experts = GroupedMLP(3, cfg, pg_collection=experts_groups())
    with pytest.raises(FeatureConfigError, match="megatron's GroupedMLP refuses it too"):
        experts(torch.randn(2, 32), torch.tensor([1, 1, 0]), torch.rand(2))


# ------------------------------------------------------------------ --use-fused-rotary-pos-emb


def rope_inputs(s=6, b=2, rot=8, freq_batch=1):
    gen = torch.Generator().manual_seed(s * 10 + rot)
    t = torch.randn(s, b, 2, 8, generator=gen, requires_grad=True)
    half = torch.randn(s, freq_batch, 1, rot // 2, generator=gen)
    return t, torch.cat([half, half], -1)


def group(size):
    return type("Group", (), {"size": lambda self: size, "rank": lambda self: 0})()


ROPE_CASES = {  # config overrides, call kwargs, rotary dim, freqs batch, expected fallback warning
    "rotate-half": (dict(), dict(), 8, 1, None),
    "interleaved": (dict(rotary_interleaved=True), dict(), 8, 1, None),
    "partial-rotary": (dict(), dict(), 4, 1, None),
    "partial-interleaved": (dict(rotary_interleaved=True), dict(), 4, 1, None),
    "cp-group-plays-no-part-in-bshd": (dict(), dict(cp_group=group(2)), 8, 1, None),
    "mrope-batch-1": (dict(mrope_section=[2, 1, 1]), dict(), 8, 1, None),
    "mscale": (dict(), dict(mscale=1.3), 8, 1, "mscale != 1"),
    "mrope-batch-2": (dict(mrope_section=[2, 1, 1]), dict(), 8, 2, "frequencies per sample"),
    "mla": (dict(multi_latent_attention=True), dict(), 8, 1, "multi-latent attention"),
}


@pytest.mark.parametrize("case", ROPE_CASES.values(), ids=ROPE_CASES.keys())
def test_fused_rope_in_every_configuration(adaptor, monkeypatch, case):
    from megatron.core.models.common.embeddings import rope_utils

    overrides, kwargs, rot, freq_batch, warning = case
    cfg = config(**overrides)
    kwargs = {"cp_group": group(1), **kwargs}
    t, freqs = rope_inputs(rot=rot, freq_batch=freq_batch)
    megatron = output_and_grads(lambda t: rope_utils.apply_rotary_pos_emb(t, freqs, cfg, **kwargs), [t])
    calls = []
    native = fused_ops.ops.rotary_pos_emb
    monkeypatch.setattr(fused_ops.ops, "rotary_pos_emb", lambda *a: calls.append(a[2]) or native(*a))
    enable(use_fused_rotary_pos_emb=True, position_embedding_type="rope")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ours = output_and_grads(lambda t: rope_utils.apply_rotary_pos_emb(t, freqs, cfg, **kwargs), [t])
    found = fallback_warnings(record)
    if warning:
        assert not calls and len(found) == 1 and warning in found[0], found
        assert_same(ours, megatron, exact=True)
    else:
        assert calls == [cfg.rotary_interleaved] and not found, found
        assert_same(ours, megatron, rtol=1e-6, atol=1e-6)


def test_fused_rope_serves_apply_rope_fusion(adaptor):
    """apply_rope_fusion asks for Transformer Engine's fused kernel, which computes the same rotation: the native
    kernel serves it (megatron without TE asserts)."""
    from megatron.core.models.common.embeddings import rope_utils

    cfg = config()
    t, freqs = rope_inputs()
    expected = rope_utils.apply_rotary_pos_emb(t, freqs, cfg, cp_group=group(1))
    cfg.apply_rope_fusion = True
    enable(use_fused_rotary_pos_emb=True, position_embedding_type="rope")
    torch.testing.assert_close(rope_utils.apply_rotary_pos_emb(t, freqs, cfg, cp_group=group(1)), expected)


@pytest.mark.parametrize("embedding", ["rope", "mrope", "yarn"])
def test_fused_rope_accepts_every_rotary_position_embedding(adaptor, embedding):
    assert "fused-rotary-pos-emb" in enable(use_fused_rotary_pos_emb=True,
                                                       position_embedding_type=embedding)
