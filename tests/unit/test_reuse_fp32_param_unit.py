"""--reuse-fp32-param: one-line refusals, the split of fp32 words into bf16 high halves and residuals (exact for
every word, ties and NaNs included), and the batched step against a plain optimizer, bit for bit."""

import argparse

import pytest
import torch

from plain_optimizer_step import plain_step_on_shared_grads
from refusals import assert_refused_in_one_line

from mm_adaptor.ops import fp32_words
from mm_adaptor.ops.library import op
from mm_adaptor.patches.optimizer.reuse_fp32_param import ReusedMainParams
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
    residual, index, kept = fp32_words.split_fp32_words(main, model)
    fp32_words.join_fp32_words(out, model, residual.zero_(), index[:0], kept[:0])  # the low halves lost
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
    stats = reused.statistics()
    assert stats["host_waits"] == 0 and stats["exceptions"] <= stats["exception_capacity"]
    assert sum(t.numel() * t.element_size() for _, _, t in reused.state_tensors()) == \
        2 * sum(m.numel() for m in mains) + 12 * stats["exception_capacity"] + 8 * len(mains)


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


def test_a_save_joins_at_most_a_batch_on_the_device_at_once(monkeypatch):
    """A checkpoint save reads the main parameters from host copies joined a batch at a time: the device never
    holds more joined fp32 words than the batch size (a larger parameter alone). The host here is "cpu:0", to which
    .to() copies, so host copies and device tensors are told apart on a CPU-only machine."""
    import weakref

    models, mains = models_and_mains(0)  # 8192, 1200, 1024 and 4000 bytes of fp32
    words = [m.detach().clone().view(torch.int32) for m in mains]
    budget = 6000
    reused = ReusedMainParams(zip(mains, models), budget_bytes=budget, host_device=torch.device("cpu", 0))
    assert reused.batches() == [[0], [1, 2], [3]]
    joined, host_copies, peak, joins = {}, set(), [0], [0]  # joined: device address -> (weakref, bytes)
    join_many, to = fp32_words.join_many, torch.Tensor.to

    def device_bytes_joined():  # written tensors still alive, or main parameters holding their storage
        held = {m.untyped_storage().data_ptr() for m in mains if m.untyped_storage().nbytes()} - host_copies
        return sum(n for ptr, (ref, n) in joined.items() if ref() is not None or ptr in held)

    def tracked_join(outs, *args):  # `outs`: joined words on the device, a batch of them
        for out in outs:
            joined[out.data_ptr()] = (weakref.ref(out), out.numel() * 4)
            joins[0] += 1
        peak[0] = max(peak[0], device_bytes_joined())
        return join_many(outs, *args)

    def tracked_to(self, *args, **kwargs):  # a copy to the host
        copy = to(self, *args, **kwargs)
        if copy is not self:
            host_copies.add(copy.data_ptr())
        return copy

    monkeypatch.setattr(fp32_words, "join_many", tracked_join)
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


# -- the step's native calls and counter reads (issue 53: launches and host reads do not follow the parameters) ---

def pieces_of(total, pieces, seed=0, grads=True):
    g = torch.Generator().manual_seed(seed)
    models = [torch.randn(total // pieces, generator=g).to(torch.bfloat16) for _ in range(pieces)]
    mains = [m.float().requires_grad_(True) for m in models]
    if grads:
        for main in mains:
            main.grad = torch.randn(main.shape, generator=g)
    return models, mains


def holder_with(models, mains, budget_bytes, **kw):
    holder = OptimizerStateHolder(torch.optim.AdamW(mains, lr=1e-2))
    reused = ReusedMainParams(zip(mains, models), budget_bytes=budget_bytes, **kw)
    holder.adopt(reused)
    return holder, reused, {id(main): model for main, model in zip(mains, models)}


class CountsOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Every operator that does work (views aside) dispatched while active, and the mm_adaptor ones by name."""

    def __init__(self):
        super().__init__()
        self.ops, self.native = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.namespace != "profiler":  # the optimizer step's record_function markers
            self.ops.append(str(func))
            if func.namespace == "mm_adaptor":
                self.native.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("budget_bytes", [2**30, 4096], ids=["one-batch", "batches-of-4KiB"])
def test_launches_per_step_follow_batches_not_parameters(budget_bytes):
    """With the inner optimizer doing nothing (no gradients), everything a step dispatches is the feature's: the
    same for 4 and 40 parameters of the same total size, two native calls per batch (one join, one rounding
    split), and no per-parameter copy into the model (megatron's copy is the split's)."""
    def ops_per_step(pieces):
        models, mains = pieces_of(4000, pieces, grads=False)
        holder, reused, model_of = holder_with(models, mains, budget_bytes)
        holder.step(model_of)  # a first step: nothing is allocated lazily in the counted one
        with CountsOps() as counted:
            holder.step(model_of)
        return counted, len(reused.batches())

    (few, few_batches), (many, many_batches) = ops_per_step(4), ops_per_step(40)
    assert few_batches == many_batches == {2**30: 1, 4096: 4}[budget_bytes]
    assert sorted(few.native) == sorted(many.native) == \
        sorted(["join_fp32_words_multi", "round_split_fp32_words"] * few_batches)
    assert sorted(few.ops) == sorted(many.ops), "ten times the parameters, the same operators"
    assert len(many.ops) <= 3 * many_batches, many.ops  # a counter's zeros, a join and a split per batch


class SlowDevice:
    """Stands in for a device the host runs ahead of: an event completes only when the test says so or the host
    waits for it. Counts the counter copies and the waits."""

    def __init__(self):
        self.events, self.waits, self.copies, self.caught_up = [], 0, 0, False

    def counters_to_host(self, counts):
        device = self

        class Event:
            done = False

            def query(self):
                return self.done or device.caught_up

            def synchronize(self):
                device.waits += 1
                self.done = True

        self.copies += 1
        on_host = counts.clone()  # what the non-blocking copy will hold once done (the test's device is the CPU)
        self.events.append(Event())
        return on_host, self.events[-1]


def run_steps(pieces, budget_bytes, device, monkeypatch, steps=3, **kw):
    from mm_adaptor.patches.optimizer import reuse_fp32_param as reuse

    monkeypatch.undo()  # an earlier run's device gone: the construction settles on the real one
    models, mains = pieces_of(4000, pieces)
    holder, reused, model_of = holder_with(models, mains, budget_bytes, **kw)
    monkeypatch.setattr(reuse, "counters_to_host", device.counters_to_host)
    waits = []
    for _ in range(steps):
        before = device.waits
        holder.step(model_of)
        waits.append(device.waits - before)
        reused.split_all()  # megatron's zero_grad, outside the step: settles what is pending
    return reused, waits


def test_no_counter_is_read_waiting_inside_the_step(monkeypatch):
    """The counters travel by a non-blocking copy per batch; a step reads them only once they have arrived. With
    room for a whole step pending, a device that has done nothing by the end of the step costs no wait in it."""
    for pieces in (4, 40):
        device = SlowDevice()
        reused, waits = run_steps(pieces, 4096, device, monkeypatch, pending_bytes=2**30)
        assert waits == [0, 0, 0], f"{pieces} parameters"
        assert device.copies == 3 * len(reused.batches()), "one copy per batch and step, not per parameter"
        assert reused.statistics()["host_waits"] == device.waits  # settled at zero_grad, outside the step


def test_a_host_far_ahead_waits_only_to_bound_the_pending_batches(monkeypatch):
    """With the default bound (one budget of main parameters pending), a host whose device has done nothing waits
    for the oldest batch, once per batch beyond the first, as often for 40 parameters as for 4; a device that keeps
    up costs no wait."""
    waits = {}
    for pieces in (4, 40):
        device = SlowDevice()
        reused, waits[pieces] = run_steps(pieces, 4096, device, monkeypatch)
        assert all(m.untyped_storage().nbytes() == 0 for m, _ in reused.pairs)
    assert waits[4] == waits[40] == [3, 3, 3]  # 4 batches: the first three waited for, each behind the next
    device = SlowDevice()
    device.caught_up = True
    assert run_steps(40, 4096, device, monkeypatch)[1] == [0, 0, 0]


def test_fused_round_and_split_equals_megatrons_copy_bit_for_bit():
    """round_split writes what megatron's fp32 -> bf16 copy writes (nearest, ties to even; -0.0, infinities,
    subnormals, the largest finite values rounding to infinity, NaNs) and splits exactly against it."""
    words = torch.cat([every_kind_of_word(), torch.tensor(
        [-2**31, 1, 0x807FFFFF, 0x00018000, 0x00008001, 0x7F7FFFFF, -8388609, 0xFF800000 - 2**32, 0x7F800001,
         0xFFC00000 - 2**32, 0x7FBFFFFF], dtype=torch.int64).to(torch.int32)])
    main = words.view(torch.float32)
    megatron = torch.empty(main.numel(), dtype=torch.bfloat16)
    megatron.copy_(main)  # Float16OptimizerWithFloat16Params._copy_main_params_to_model_params
    for name, split in (("native", op("round_split_fp32_words")), ("reference", fp32_words.reference_round_split)):
        model = torch.full_like(megatron, 7.0)
        residual = torch.empty(main.numel(), dtype=torch.int16)
        index, kept = torch.empty(5000, dtype=torch.int64), torch.empty(5000, dtype=torch.int32)
        counts = torch.zeros(1, dtype=torch.int64)
        split([main], [model], [residual], [index], [kept], counts, True)
        nan = torch.isnan(main)
        assert torch.equal(model.view(torch.int16)[~nan], megatron.view(torch.int16)[~nan]), name
        assert torch.isnan(model[nan]).all(), name
        if name == "reference" or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            assert torch.equal(model.view(torch.int16), megatron.view(torch.int16)), f"{name}: NaN bits"
        assert int(counts) <= 5000
        out = torch.empty_like(main)
        fp32_words.join_many([out], [model], [residual], [index], [kept], [counts])
        assert torch.equal(out.view(torch.int32), words), name


def test_exceptions_beyond_their_buffer_are_split_again_without_loss(monkeypatch):
    """A parameter whose exceptions outnumber its buffer (here: room for one) keeps its words whole until the host
    has read its counter, then is split again with room for all; every step stays bit for bit."""
    from mm_adaptor.patches.optimizer import reuse_fp32_param as reuse

    monkeypatch.setattr(reuse, "exception_capacity", lambda numel: 1)
    words = every_kind_of_word()[:4096]  # random words with ties among them
    words[::64] = (words[::64] >> 17 << 17) + 0x8000  # ties rounded down to even: 64 exceptions at least
    mains_ref = [words.view(torch.float32).clone().requires_grad_(True)]
    models_ref = [mains_ref[0].detach().to(torch.bfloat16)]
    mains = [mains_ref[0].detach().clone().requires_grad_(True)]
    models = [models_ref[0].clone()]
    ref = torch.optim.AdamW(mains_ref, lr=0.0)  # the words, ties included, stay: every split overflows
    holder, reused, model_of = holder_with(models, mains, 2**30)
    holder.inner.param_groups[0]["lr"] = 0.0
    assert reused.resplits == 1 and reused.exception_index[0].numel() >= 64, "split again at construction"
    device = SlowDevice()
    monkeypatch.setattr(reuse, "counters_to_host", device.counters_to_host)
    join = reused.before

    def join_then_shrink(n):  # once the words are whole, room for one exception again: every split overflows
        join(n)
        reused.exception_index[0] = reused.exception_index[0][:1]
        reused.exception_words[0] = reused.exception_words[0][:1]

    reused.before = join_then_shrink
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        plain_step_on_shared_grads(ref, mains_ref, mains, models_ref, g)
        holder.step(model_of)
        assert mains[0].untyped_storage().nbytes() > 0, "pending: the words are still whole"
        assert torch.equal(models[0].view(torch.int16), models_ref[0].view(torch.int16))
        reused.split_all()  # the counter arrives: an overflow, split again from the whole words
        assert mains[0].untyped_storage().nbytes() == 0
    assert reused.resplits == 4
    reused.join_all()
    assert torch.equal(mains[0].detach().view(torch.int32), mains_ref[0].detach().view(torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_a_cuda_step_never_synchronises():
    """Under torch.cuda.set_sync_debug_mode("error") a step over many parameters and batches runs (any call that
    synchronises the host with the device raises), with no wait, bit for bit against the plain optimizer."""
    g = torch.Generator().manual_seed(0)
    sizes = [4099, 1 << 16, 37, 300_001, 8, 65_536 * 3 + 5] * 4
    models = [torch.randn(n, generator=g).to(torch.bfloat16).cuda() for n in sizes]
    mains = [m.float().requires_grad_(True) for m in models]
    mains_ref = [m.detach().clone().requires_grad_(True) for m in mains]
    models_ref = [m.clone() for m in models]
    for main, main_ref in zip(mains, mains_ref):
        main.grad = torch.randn(main.shape, generator=g).cuda()
        main_ref.grad = main.grad.clone()
    ref = torch.optim.AdamW(mains_ref, lr=1e-2)
    holder, reused, model_of = holder_with(models, mains, 1 << 20, pending_bytes=1 << 40)
    holder.inner = torch.optim.AdamW(mains, lr=1e-2, capturable=True)  # no host read of the step count
    for group in ref.param_groups:
        group["capturable"] = True
    holder.step(model_of)  # warm-up: kernels loaded, buffers and pinned memory allocated
    ref.step()
    for model, main in zip(models_ref, mains_ref):
        model.copy_(main.detach())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        holder.step(model_of)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref.step()
    for model, main in zip(models_ref, mains_ref):
        model.copy_(main.detach())
    assert reused.host_waits == 0
    assert all(torch.equal(a, b) for a, b in zip(models, models_ref)), "the model values are megatron's copy's"
    reused.join_all()
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(mains, mains_ref))
