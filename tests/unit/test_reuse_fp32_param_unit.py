"""--reuse-fp32-param: one-line refusals, the split of fp32 words into bf16 high halves and residuals (exact for
every word, ties and NaNs included), and the batched step against a plain optimizer, bit for bit."""

import argparse

import pytest
import torch

from plain_optimizer_step import plain_step_on_shared_grads
from refusals import assert_refused_in_one_line

from mm_adaptor.ops import fp32_words
from mm_adaptor.patches.optimizer.reuse_fp32_param import ReusedMainParams, split_words
from mm_adaptor.patches.optimizer.state_holder import OptimizerStateHolder


def reference_split(main, model):
    residual, index, kept, count = fp32_words.reference_split(main, model, main.numel())
    return residual, index[:int(count)], kept[:int(count)]


# the native kernels (what the feature runs) and the plain-PyTorch references they are checked against
CODECS = {"native": (fp32_words.split_fp32_words, fp32_words.join_fp32_words),
          "reference": (reference_split, fp32_words.reference_join)}


def options(**kw):
    base = dict(reuse_fp32_param=True, reuse_fp32_param_batch_mb=None, bf16=True)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("kw,names", [
    (dict(reuse_fp32_param=False, reuse_fp32_param_batch_mb=8), ["--reuse-fp32-param-batch-mb", "needs"]),
    (dict(reuse_fp32_param_batch_mb=0), ["--reuse-fp32-param-batch-mb 0"]),
    (dict(bf16=False), ["--reuse-fp32-param", "--bf16"]),
    (dict(bf16=False, fp16=True), ["--bf16", "--fp16"]),
    (dict(use_precision_aware_optimizer=True), ["--use-precision-aware-optimizer"]),
    (dict(optimizer_cpu_offload=True), ["--optimizer-cpu-offload"]),
])
def test_refusals_are_one_line_naming_the_flags(kw, names):
    assert_refused_in_one_line("reuse-fp32-param", options(**kw), names)


def every_kind_of_word():
    g = torch.Generator().manual_seed(0)
    random_words = torch.randint(-2**31, 2**31, (200_000,), dtype=torch.int64, generator=g)
    high = torch.randint(-2**15, 2**15, (2000,), dtype=torch.int64, generator=g)
    ties = high * 65536 + 0x8000  # exactly half way between two bf16 values: round to even
    edges = torch.tensor([0, -2**31, 2**31 - 1, 0x7F800000, -8388608, 0x7FC00000, 0x7F7FFFFF, 0x7F7F8000, 0x00008000,
                          -2147450880, 1], dtype=torch.int64)
    return torch.cat([random_words, ties.clamp(-2**31, 2**31 - 1), edges]).to(torch.int32)


@pytest.mark.parametrize("codec", CODECS)
def test_split_and_join_give_back_every_word(codec):
    split, join = CODECS[codec]
    words = every_kind_of_word()
    main = words.view(torch.float32)
    model = main.to(torch.bfloat16)  # megatron's copy: round to nearest even
    residual, index, kept = split(main, model)
    assert residual.dtype == torch.int16 and residual.numel() == main.numel()
    out = torch.full_like(main, float("nan"))
    join(model, residual, index, kept, out) if codec == "reference" else join(out, model, residual, index, kept)
    assert torch.equal(out.view(torch.int32), words)
    assert torch.equal(index, index.sort().values), "exception positions ascend"
    # among finite words, the one difference a 16-bit residual cannot hold: half way, rounded down to even
    ties_to_even_below = ((words & 0x1FFFF) == 0x8000) & torch.isfinite(main)
    kept_whole = torch.zeros_like(ties_to_even_below)
    kept_whole[index] = True
    assert torch.equal(kept_whole & torch.isfinite(main), ties_to_even_below)


def test_split_is_exact_for_any_model_values():
    """A checkpoint's model values need not be the rounded main values: what does not fit is kept whole."""
    words = every_kind_of_word()
    main = words.view(torch.float32)
    model = torch.randn(main.numel(), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    native = fp32_words.split_fp32_words(main, model)
    for got, expected in zip(native, reference_split(main, model)):
        assert torch.equal(got, expected)
    out = torch.empty_like(main)
    fp32_words.join_fp32_words(out, model, *native)
    assert torch.equal(out.view(torch.int32), words)


def test_codec_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="bf16 high halves of the same size"):
        fp32_words.split_fp32_words(torch.zeros(4), torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous fp32"):
        fp32_words.join_fp32_words(torch.zeros(4, 2).t(), torch.zeros(8, dtype=torch.bfloat16),
                                   *fp32_words.split_fp32_words(torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)))


def test_dropping_the_low_bits_is_not_exact():
    main = torch.randn(1000)
    model = main.to(torch.bfloat16)
    out = torch.empty_like(main)
    fp32_words.join_fp32_words(out, model, *split_words(main, model, keep_low_bits=False))
    assert not torch.equal(out, main)


class CountsStepsPerGroup(torch.optim.AdamW):
    """Like Transformer Engine's FusedAdam: the step count lives in the group and a group without params keeps it."""

    def step(self, closure=None):
        for group in self.param_groups:
            if group["params"]:
                group["step"] = group.get("step", 0) + 1
        return super().step(closure)


def models_and_mains(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (300,), (16, 16), (1000,)]
    models = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
    mains = [m.float() for m in models]
    for main in mains:
        main.requires_grad_(True)
    return models, mains


@pytest.mark.parametrize("budget_bytes", [1, 4096, 2**30], ids=["one-param-batches", "mixed", "one-batch"])
def test_batched_step_matches_the_plain_optimizer_bit_for_bit(budget_bytes):
    models_ref, mains_ref = models_and_mains(0)
    models, mains = models_and_mains(0)
    fp32_ref, fp32 = torch.randn(10, requires_grad=True), None
    fp32 = fp32_ref.detach().clone().requires_grad_(True)
    groups = lambda ms, extra: [{"params": ms[:2] + [extra]}, {"params": ms[2:], "weight_decay": 0.0}]  # noqa: E731
    ref = CountsStepsPerGroup(groups(mains_ref, fp32_ref), lr=1e-2)
    opt = CountsStepsPerGroup(groups(mains, fp32), lr=1e-2)
    reused = ReusedMainParams(zip(mains, models), budget_bytes=budget_bytes)
    holder = OptimizerStateHolder(opt)
    holder.adopt(reused)
    model_of = {id(main): model for main, model in zip(mains, models)}
    assert all(m.untyped_storage().nbytes() == 0 for m in mains), "the main copies are released between steps"
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        plain_step_on_shared_grads(ref, [*mains_ref, fp32_ref], [*mains, fp32], models_ref, g)
        holder.step(model_of)
        assert [m.untyped_storage().nbytes() for m in mains] == [0] * len(mains)
        for a, b in zip(models_ref, models):
            assert torch.equal(a, b)
        assert torch.equal(fp32_ref, fp32), "a parameter without a pair steps once"
    assert [g["step"] for g in opt.param_groups] == [g["step"] for g in ref.param_groups] == [5, 5]
    assert len(reused.batches()) == {1: len(mains), 4096: 3, 2**30: 1}[budget_bytes]
    reused.join_all()
    for a, b in zip(mains_ref, mains):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), "restored fp32 words"
    for main_ref, main in zip(mains_ref, mains):
        a, b = ref.state[main_ref], opt.state[main]
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    reused.split_all()
    assert sum(t.numel() * t.element_size() for _, _, t in reused.state_tensors()) == \
        2 * sum(m.numel() for m in mains) + 12 * reused.statistics()["exceptions"]


@pytest.mark.parametrize("feature,kw,names", [
    ("swap-optimizer", dict(swap_optimizer=True), ["--swap-optimizer", "--use-distributed-optimizer"]),
    ("swap-optimizer", dict(swap_optimizer=False, swap_optimizer_batch_mb=4), ["--swap-optimizer-batch-mb", "needs"]),
    ("swap-optimizer", dict(swap_optimizer=True, use_distributed_optimizer=True, reuse_fp32_param=True),
     ["--swap-optimizer", "--reuse-fp32-param"]),
    ("swap-optimizer", dict(swap_optimizer=True, use_distributed_optimizer=True, optimizer_cpu_offload=True),
     ["--optimizer-cpu-offload"]),
    ("virtual-optimizer", dict(virtual_optimizer=-1.0), ["--virtual-optimizer -1", "negative"]),
    ("virtual-optimizer", dict(virtual_optimizer=2.0, swap_optimizer=True),
     ["--virtual-optimizer", "--swap-optimizer"]),
    ("reuse-fp32-param", dict(reuse_fp32_param=True, bf16=True, swap_optimizer=True), ["--swap-optimizer"]),
])
def test_optimizer_state_features_refuse_in_one_line(feature, kw, names):
    assert_refused_in_one_line(feature, argparse.Namespace(**kw), names)


def test_virtual_optimizer_value_is_optional():
    import math

    from mm_adaptor.harness.runner import parse_args

    assert parse_args(["--virtual-optimizer"]).virtual_optimizer == math.inf
    assert parse_args(["--virtual-optimizer", "2.5", "--bf16"]).virtual_optimizer == 2.5
    assert parse_args([]).virtual_optimizer is None


@pytest.mark.parametrize("budget_bytes", [2**30, 4096], ids=["one-batch", "batches-of-4KiB"])
def test_host_syncs_per_step_follow_batches_not_parameters(budget_bytes, monkeypatch):
    """The split reads its exception counts to the host once per batch (fp32_words.counts_to_host, the one read
    back the CPU and CUDA paths share), so a step with 10x the parameters of the same total size waits as often."""
    synced = []
    to_host = fp32_words.counts_to_host
    monkeypatch.setattr(fp32_words, "counts_to_host", lambda counts: synced.append(len(counts)) or to_host(counts))

    def syncs_per_step(pieces):
        g = torch.Generator().manual_seed(pieces)
        models = [torch.randn(4000 // pieces, generator=g).to(torch.bfloat16) for _ in range(pieces)]
        mains = [m.float().requires_grad_(True) for m in models]
        holder = OptimizerStateHolder(torch.optim.AdamW(mains, lr=1e-2))
        reused = ReusedMainParams(zip(mains, models), budget_bytes=budget_bytes)
        holder.adopt(reused)
        for main in mains:
            main.grad = torch.randn(main.shape, generator=g)
        synced.clear()
        holder.step({id(main): model for main, model in zip(mains, models)})
        assert sum(synced) == pieces, "every parameter was split, its count read back with its batch's"
        return len(synced), len(reused.batches())

    (few_syncs, few_batches), (many_syncs, many_batches) = syncs_per_step(4), syncs_per_step(40)
    assert few_syncs == few_batches and many_syncs == many_batches, "one read back per batch"
    assert many_syncs == few_syncs, "ten times the parameters, as many read backs"


def test_a_save_joins_at_most_a_batch_on_the_device_at_once(monkeypatch):
    """A checkpoint save reads the main parameters from host copies joined a batch at a time: the device never
    holds more joined fp32 words than the batch size (a larger parameter alone). The host here is "cpu:0", to which
    .to() copies, so host copies and device tensors are told apart on a CPU-only machine."""
    import weakref

    from mm_adaptor.patches.optimizer import reuse_fp32_param as reuse

    models, mains = models_and_mains(0)  # 8192, 1200, 1024 and 4000 bytes of fp32
    words = [m.detach().clone().view(torch.int32) for m in mains]
    budget = 6000
    reused = ReusedMainParams(zip(mains, models), budget_bytes=budget, host_device=torch.device("cpu", 0))
    assert reused.batches() == [[0], [1, 2], [3]]
    joined, host_copies, peak, joins = {}, set(), [0], [0]  # joined: device address -> (weakref, bytes)
    join, to = reuse.join_fp32_words, torch.Tensor.to

    def device_bytes_joined():  # written tensors still alive, or main parameters holding their storage
        held = {m.untyped_storage().data_ptr() for m in mains if m.untyped_storage().nbytes()} - host_copies
        return sum(n for ptr, (ref, n) in joined.items() if ref() is not None or ptr in held)

    def tracked_join(out, *args):  # `out`: joined words on the device
        joined[out.data_ptr()] = (weakref.ref(out), out.numel() * 4)
        joins[0] += 1
        peak[0] = max(peak[0], device_bytes_joined())
        return join(out, *args)

    def tracked_to(self, *args, **kwargs):  # a copy to the host
        copy = to(self, *args, **kwargs)
        if copy is not self:
            host_copies.add(copy.data_ptr())
        return copy

    monkeypatch.setattr(reuse, "join_fp32_words", tracked_join)
    monkeypatch.setattr(torch.Tensor, "to", tracked_to)
    reused.readable()
    monkeypatch.undo()
    assert joins[0] == 4, "every main parameter was joined for the save"
    largest = max(m.numel() * 4 for m in mains)
    assert peak[0] <= max(budget, largest) and peak[0] < sum(m.numel() * 4 for m in mains), peak[0]
    assert reused.statistics()["most_main_param_bytes_whole_for_a_save"] == largest  # [0] alone; [1, 2] 2224 bytes
    assert all(torch.equal(m.detach().view(torch.int32), w) for m, w in zip(mains, words)), "exact host copies"
    reused.split_all()
    assert all(m.untyped_storage().nbytes() == 0 for m in mains), "host copies dropped at the next zero_grad"
