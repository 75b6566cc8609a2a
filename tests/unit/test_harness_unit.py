import math

import pytest
import torch

from mm_adaptor import harness
from mm_adaptor.cli.check import _split_feature_args
from mm_adaptor.harness import verdict


def test_tolerance_of_an_exact_feature():
    tol = harness.tolerance_for(["--optimize-vocab-parallel-ce"])
    assert tol.exact and "--optimize-vocab-parallel-ce" in tol.why


def test_tolerance_of_inexact_features_names_each_and_takes_the_largest_factor():
    tol = harness.tolerance_for(["--use-fused-rmsnorm", "--optimize-vocab-parallel-ce", "--use-fused-swiglu"])
    assert not tol.exact
    assert "--use-fused-rmsnorm" in tol.why and "--use-fused-swiglu" in tol.why
    assert "--optimize-vocab-parallel-ce" not in tol.why


def test_no_feature_is_an_error():
    with pytest.raises(harness.HarnessError, match="no feature is switched on"):
        harness.tolerance_for(["--bf16"])


def test_feature_flags_are_split_from_training_flags():
    feats, rest = _split_feature_args(["--bf16", "--optimize-vocab-parallel-ce", "--num-layers", "2"],
                                      {"--optimize-vocab-parallel-ce"})
    assert feats == ["--optimize-vocab-parallel-ce"] and rest == ["--bf16", "--num-layers", "2"]


def _dump(losses=(1.0,), grads=None, activations=None, params=None, initial=None):
    from mm_adaptor.harness.runner import Dump, RankDump

    rank = RankDump(rank=0, losses=list(losses), grad_norms=[None] * len(losses), grads=grads or [],
                    activations=activations or {}, params=params or {}, initial_params=initial or {})
    return Dump(ranks=[rank])


def test_kinds_group_layers_experts_and_chunks():
    assert verdict.kind_of("chunk1.module.decoder.layers.3.mlp.local_experts.2.linear_fc1.weight") == \
        "module.decoder.layers.*.mlp.local_experts.*.linear_fc1.weight"
    assert verdict.kind_of("chunk0.L12.self_attention") == "L*.self_attention"


def test_bit_for_bit_verdict_reports_any_difference():
    off = _dump(losses=[2.0], grads=[{"a": torch.ones(3), "b": torch.ones(3)}])
    on = _dump(losses=[2.0], grads=[{"a": torch.ones(3), "b": torch.tensor([1.0, 1.0, 1.0 + 2**-20])}])
    verdicts = verdict.judge(off, on, verdict.Limits("fp32", None))
    assert [f.split(":")[0] for f in verdicts["gradients"].failures] == ["step 1 rank 0 b"]
    assert not verdicts["loss"].failures


def test_limits_follow_the_noise_of_the_same_kind_with_a_one_rounding_floor():
    torch.manual_seed(0)
    g = torch.randn(1000)
    noisy = {"layers.0.w": g, "layers.1.w": g}
    off = _dump(grads=[noisy])
    noise = _dump(grads=[{"layers.0.w": g * (1 + 1e-4 * torch.randn(1000)), "layers.1.w": g}])
    table = verdict.noise_table(off, noise)
    limits = verdict.Limits("fp32", table)
    point = verdict.Point("gradients", 1, 0, "layers.1.w", g, g)
    k = verdict.K_FIRST_STEP
    assert limits.of(point, "rel_norm") == pytest.approx(k * 1e-4, rel=0.1), "layer 0's noise covers layer 1"
    assert limits.of(verdict.Point("gradients", 1, 0, "other", g, g), "rel_norm") == \
        k * verdict.UNIT_ROUNDOFF["fp32"], "no noise measured: the floor"
    later = verdict.Point("gradients", 2, 0, "other", g, g)
    assert limits.of(later, "rel_norm") == verdict.K_LATER_STEPS * verdict.UNIT_ROUNDOFF["fp32"]
    spread = verdict.ISOTROPIC_ALLOWANCE * limits.of(point, "rel_norm") / k / 1000**0.5
    floor = verdict.floors("fp32")["scale"]  # gradients: fixed (their noise is shared along the tokens)
    assert limits.of(point, "scale") == pytest.approx(k * max(spread, floor), rel=1e-6), \
        "a scale noise sample smaller than the noise's norm spread over 1000 elements is not trusted"
    fine = _dump(grads=[{"layers.0.w": g * (1 + 1e-4 * torch.randn(1000)), "layers.1.w": g}])
    assert not verdict.judge(off, fine, limits)["gradients"].failures
    scaled = _dump(grads=[{"layers.0.w": g, "layers.1.w": g * 1.002}])
    failures = verdict.judge(off, scaled, limits)["gradients"].failures
    assert len(failures) == 1 and "scale 2.00e-03" in failures[0]


def test_statistics_separate_a_scale_error_from_noise_of_the_same_size():
    torch.manual_seed(0)
    off = torch.randn(4096)
    noise = off + 2e-3 * off.abs().mean() * torch.randn(4096)
    scaled = off * 1.002
    s_noise, s_scaled = verdict.statistics(off, noise), verdict.statistics(off, scaled)
    assert s_noise["rel_norm"] == pytest.approx(s_scaled["rel_norm"], rel=0.5)
    assert s_scaled["scale"] == pytest.approx(2e-3, rel=1e-4)  # the product rounds in float32
    assert s_noise["scale"] < s_scaled["scale"] / 20


def test_statistics_of_zero_and_equal_tensors():
    zero = torch.zeros(3)
    assert verdict.statistics(zero, zero) == dict.fromkeys(verdict.STATISTICS, 0.0)
    assert all(math.isinf(v) for v in verdict.statistics(zero, torch.ones(3)).values())
    stats = verdict.statistics(torch.ones(4), torch.tensor([1.0, 1.0, 1.0, 1.5]))
    assert stats["rel_max"] == pytest.approx(0.5) and stats["rel_norm"] == pytest.approx(0.25)


def test_parameters_are_judged_by_what_training_changed():
    initial = {"w": torch.full((10,), 100.0)}
    off = _dump(params={"w": torch.full((10,), 100.01)}, initial=initial)
    on = _dump(params={"w": torch.full((10,), 99.99)}, initial=initial)
    verdicts = verdict.judge(off, on, verdict.Limits("bf16", {}))
    assert verdicts["parameters"].failures, "an update the other way fails although the values differ by 2e-4"
    close = _dump(params={"w": torch.full((10,), 100.015)}, initial=initial)
    assert not verdict.judge(off, close, verdict.Limits("bf16", {}))["parameters"].failures


def test_a_tensor_recorded_in_one_run_only_fails():
    off = _dump(activations={"chunk0.L1.mlp": torch.ones(2)})
    on = _dump(activations={})
    assert "recorded in only one run" in verdict.judge(off, on, verdict.Limits("fp32", {}))["activations"].failures[0]


def test_floors_are_one_rounding_of_each_precision():
    for precision in ("fp32", "bf16", "fp16"):
        floors = verdict.floors(precision)
        assert floors["rel_norm"] == verdict.UNIT_ROUNDOFF[precision]
        assert 0 < floors["scale"] < floors["rel_norm"] < floors["rel_max"]
        assert 0 < verdict.scale_floor(precision, torch.ones(16)) < floors["rel_norm"]


def test_energy_count_counts_the_elements_that_carry_the_norm():
    assert verdict.energy_count(torch.full((1000,), -3.0)) == pytest.approx(1000)
    assert verdict.energy_count(torch.cat([torch.ones(10), torch.zeros(990)])) == pytest.approx(10)
    assert verdict.energy_count(torch.zeros(5)) == 1.0


def _bf16_rounding_of(x):
    return x.bfloat16().float()


def test_scale_floor_shrinks_like_one_over_sqrt_n_and_bounds_one_rounding():
    torch.manual_seed(0)
    small, large = torch.randn(64), torch.randn(64 * 100)
    assert verdict.scale_floor("bf16", small) / verdict.scale_floor("bf16", large) == pytest.approx(10, rel=0.3)
    scales = []
    for _ in range(300):
        x = torch.randn(4096)
        scales.append(verdict.statistics(x, _bf16_rounding_of(x))["scale"])
    one_sd_bound = verdict.scale_floor("bf16", x) / verdict.ISOTROPIC_ALLOWANCE  # u / sqrt(3 n_eff)
    measured_sd = math.sqrt(sum(s * s for s in scales) / len(scales))
    assert 0.5 * one_sd_bound < measured_sd <= one_sd_bound
    point = verdict.Point("activations", 1, 0, "L1.mlp", x, x)
    assert max(scales) < verdict.Limits("bf16", {}).of(point, "scale") / 2


def _judged_scale(precision, off, on):
    point = verdict.Point("activations", 1, 0, "L1.mlp", off, on)
    limit = verdict.Limits(precision, {}).of(point, "scale")
    return verdict.statistics(off, on)["scale"] / limit


def test_one_signed_error_below_one_rounding_fails_a_large_tensor_and_passes_a_small_one():
    """x 1.0008 computed in fp32 and rounded once to bf16 moves a fifth of a rounding per element, one way."""
    torch.manual_seed(0)
    for n, fails in ((8192, True), (64, False)):
        x = torch.randn(n)
        assert (_judged_scale("bf16", _bf16_rounding_of(x), _bf16_rounding_of(x * 1.0008)) > 1) == fails, n
    x = torch.randn(8192)
    other_rounding = _bf16_rounding_of(x * (1 + 2**-9 * torch.randn(8192)))
    assert _judged_scale("bf16", _bf16_rounding_of(x), other_rounding) < 0.5


def test_unknown_layout():
    with pytest.raises(harness.HarnessError, match="unknown layout"):
        harness.compare(["--optimize-vocab-parallel-ce"], layout="tp9")


def test_bad_configuration_is_refused_before_anything_trains():
    with pytest.raises(harness.HarnessError, match="--normalization RMSNorm"):
        harness.compare(["--use-fused-rmsnorm"], layout="tp2", timeout=1)


def test_every_step_takes_the_largest_noise_of_the_draws():
    """From step 2 on one perturbation's draw at the few parameters below Adam's eps can be zero, and at step 1 one
    draw can sit low at a kind (compare.NOISE_PARTS): every draw counts at every step."""
    g = torch.linspace(1, 2, 100)
    off = _dump(losses=[1.0, 1.0], grads=[{"w": g}, {"w": g}])
    halves = _dump(losses=[1.0, 1.0], grads=[{"w": g * (1 + 1e-6)}, {"w": g}])
    thirds = _dump(losses=[1.0, 1.0], grads=[{"w": g * (1 + 1e-3)}, {"w": g * (1 + 1e-4)}])
    table = verdict.noise_table(off, halves, thirds)
    assert table[("gradients", "w", 1)]["rel_norm"] == pytest.approx(1e-3, rel=0.1)
    assert table[("gradients", "w", 2)]["rel_norm"] == pytest.approx(1e-4, rel=0.1)
    assert verdict.noise_table(off, halves)[("gradients", "w", 1)]["rel_norm"] == pytest.approx(1e-6, rel=0.1)
    assert verdict.noise_table(off, halves)[("gradients", "w", 2)]["rel_norm"] == 0.0


def test_a_device_that_is_not_bitwise_reproducible_adds_an_unperturbed_repeat(monkeypatch):
    from mm_adaptor import devices
    import importlib

    compare = importlib.import_module("mm_adaptor.harness.compare")  # the package's `compare` is the function
    assert compare.noise_draws() == ("matrix products in halves", "matrix products in thirds")
    assert devices.make("cpu").bitwise_reproducible
    for name in ("cuda", "npu"):
        backend = devices.make(name)
        assert not backend.bitwise_reproducible
        monkeypatch.setattr(devices, "current_or_chosen", lambda backend=backend: backend)
        *perturbations, repeat = compare.noise_draws()
        assert len(perturbations) == len(compare.NOISE_PARTS)
        assert repeat == f"an unperturbed repeat ({name} is not bitwise reproducible)"


def _split_k_patches(parts=2):
    from mm_adaptor.harness import split_k

    return split_k.perturbation_patches(parts)


@pytest.mark.parametrize("op", ["bmm", "baddbmm"])
def test_the_perturbation_splits_batched_products_in_their_backward_too(op):
    """Attention's batched products: the split forward's native backward keeps the unsplit rounding (each
    gradient's inner dimension is not the one split), so the backward is split too."""
    torch.manual_seed(0)
    a = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(3, 64, 6, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(3, 5, 6, dtype=torch.bfloat16)
    grad = torch.randn(3, 5, 6, dtype=torch.bfloat16)

    def run():
        a.grad = b.grad = None
        out = torch.bmm(a, b) if op == "bmm" else torch.baddbmm(bias, a, b, beta=0.0, alpha=0.5)
        out.backward(grad * 64)  # a large inner dimension of the gradients (64 rows of grad_b's product)
        return out.detach(), a.grad.clone(), b.grad.clone()

    native = run()
    patches = _split_k_patches()
    patches.apply()
    try:
        split = run()
    finally:
        patches.revert()
    for x, y, what in zip(native, split, ("output", "grad a", "grad b")):
        exact = x.double()
        assert not torch.equal(x, y), f"{what}: the split must round differently somewhere"
        assert float((y.double() - exact).norm() / exact.norm()) < 2e-2, f"{what}: the same math"
