"""--swap-attention: one-line refusals, --swap-modules parsing, the CPU backend's stream API, and the mechanism on a
3-layer GPT in one rank: gradients bit-for-bit, device bytes of the swapped modules gone (but for the block's input,
which the model still holds), host bytes equal to what left, prefetch order, on-demand fetch, pool reuse (these with
--swap-select all, every layer swapped); the bandwidth selection (the default) with stand-in link rates and layer
times: the block's last layer never swapped, a layer whose copy outlasts the next layer's forward not swapped, one
that fits swapped, the reported GB/s the stand-in's bytes over time."""

import argparse

import pytest
import torch

import mm_adaptor
from refusals import assert_refused_in_one_line

from mm_adaptor.core.features import get


def options(**kw):
    base = dict(swap_attention=True, swap_modules=None, swap_prefetch_distance=None, swap_min_bytes=None,
                swap_select=None, transformer_impl="local")
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("kw,names", [
    (dict(swap_attention=False, swap_prefetch_distance=2), ["--swap-prefetch-distance needs --swap-attention"]),
    (dict(swap_attention=False, swap_modules="mlp", swap_min_bytes=0),
     ["--swap-modules and --swap-min-bytes need --swap-attention"]),
    (dict(swap_modules="self_attention,attn"), ["--swap-modules", "'attn'", "input_layernorm"]),
    (dict(swap_modules=" , "), ["--swap-modules names no module"]),
    (dict(swap_prefetch_distance=-1), ["--swap-prefetch-distance -1"]),
    (dict(swap_min_bytes=-5), ["--swap-min-bytes -5"]),
    (dict(swap_attention=False, swap_select="all"), ["--swap-select needs --swap-attention"]),
    (dict(swap_select="fastest"), ["--swap-select 'fastest'", "bandwidth or all"]),
    (dict(recompute_granularity="full", recompute_method="uniform"),
     ["--recompute-granularity full", "--recompute-method uniform"]),
    (dict(cpu_offloading=True), ["--cpu-offloading"]),
    (dict(fine_grained_activation_offloading=True), ["--fine-grained-activation-offloading"]),
    (dict(transformer_impl="transformer_engine"), ["--transformer-impl local"]),
])
def test_refusals_are_one_line_naming_the_flags(kw, names):
    assert_refused_in_one_line("swap-attention", options(**kw), names,
                               "a tuning flag alone counts as asking, so that it can be refused")


def test_module_names():
    from mm_adaptor.patches.transformer.swap_attention import DEFAULT_MODULES, module_names

    assert module_names(None) == DEFAULT_MODULES == ("input_layernorm", "self_attention", "pre_mlp_layernorm")
    assert module_names("input_norm, self_attention,post_attention_norm,self_attention") == DEFAULT_MODULES
    assert module_names("mlp") == ("mlp",)


@pytest.mark.parametrize("kw", [dict(), dict(swap_modules="input_norm,post_attention_norm"),
                                dict(swap_prefetch_distance=0, swap_min_bytes=0),
                                dict(swap_select="all"), dict(swap_select="bandwidth"),
                                dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
                                dict(recompute_granularity="selective", recompute_modules=["core_attn"])])
def test_accepted(kw):
    get("swap-attention").validate(options(**kw))


def test_select_modes_are_the_patch_modules():
    from mm_adaptor.feature_flags import swap_attention as flags
    from mm_adaptor.patches.transformer import swap_attention as sa

    assert flags.SELECT_MODES == sa.SELECT_MODES and flags.DEFAULT_SELECT == sa.DEFAULT_SELECT == "bandwidth"
    assert flags.manager_options(options())["select"] == "bandwidth"
    assert flags.manager_options(options(swap_select="all"))["select"] == "all"


# the bandwidth selection with stand-in link rates and layer times (no model)


def timing(number, window_ms, copied_bytes, copy_ms=1.0, last=False):
    from mm_adaptor.patches.transformer.swap_attention import LayerTiming

    return LayerTiming(number, window_ms, copied_bytes, copy_ms, last)


def test_a_layer_is_chosen_only_if_its_copy_ends_within_the_next_layers_forward():
    from mm_adaptor.patches.transformer.swap_attention import select_layers

    mb_per_ms = 1e6  # 1 MB per ms: 1 GB/s
    # layer 1: 3 MB in a 4 ms window fits; layer 2: 5 MB in 4 ms does not; layer 3 fits; layer 4 is the last
    timings = [timing(1, 4.0, 3_000_000), timing(2, 4.0, 5_000_000), timing(3, 4.0, 4_000_000),
               timing(4, 4.0, 1, last=True)]
    assert select_layers(timings, mb_per_ms) == [True, False, True, False]
    # the same bytes over a link twice as fast: all but the last fit
    assert select_layers(timings, 2 * mb_per_ms) == [True, True, True, False]
    # nothing copied (every storage under --swap-min-bytes) or no rate measured: nothing chosen
    assert select_layers([timing(1, 4.0, 0), timing(2, 4.0, 0, last=True)], mb_per_ms) == [False, False]
    assert select_layers(timings, None) == [False] * 4


def test_the_last_layer_is_never_chosen_however_fast_the_link():
    from mm_adaptor.patches.transformer.swap_attention import select_layers

    assert select_layers([timing(7, 1e9, 1, last=True)], 1e12) == [False]


def test_the_window_is_the_next_layers_forward_and_a_refused_layer_leaves_the_next_free():
    from mm_adaptor.patches.transformer.swap_attention import select_layers

    # layer 1's 3.5 ms copy outlasts layer 2's 2 ms forward: not swapped, so no copy of it delays layer 2's; a copy
    # that ends exactly when the next forward does is hidden (1 MB at 1 MB/ms in a 1 ms window)
    timings = [timing(1, 2.0, 3_500_000), timing(2, 1.0, 1_000_000), timing(3, 2.0, 0, last=True)]
    assert select_layers(timings, 1e6) == [False, True, False]


def test_reported_link_rate_is_bytes_over_time():
    from mm_adaptor.patches.transformer.swap_attention import gb_per_s, link_bytes_per_ms

    timings = [timing(1, 4.0, 3_000_000, copy_ms=2.0), timing(2, 4.0, 5_000_000, copy_ms=3.0),
               timing(3, 4.0, 0, copy_ms=9.0, last=True)]
    assert link_bytes_per_ms(timings) == 8_000_000 / 5.0
    assert gb_per_s(link_bytes_per_ms(timings)) == 8_000_000 / 5.0 / 1e6  # 1.6 GB/s
    assert link_bytes_per_ms([timing(1, 4.0, 0)]) is None


def test_cpu_backend_streams_are_ordered_no_ops():
    from mm_adaptor.devices.cpu import CpuBackend

    backend = CpuBackend()
    stream, event = backend.new_stream(), backend.new_event()
    stream.wait_stream(backend.current_stream())
    with backend.use_stream(stream):
        buffer = backend.host_buffer(16)
        buffer.copy_(torch.arange(16, dtype=torch.uint8))
        event.record(stream)
    backend.current_stream().wait_event(event)
    assert buffer.dtype == torch.uint8 and not buffer.is_pinned() and buffer.sum() == 120


# the mechanism, in one rank on the CPU backend


def build(extra):
    from megatron.core import tensor_parallel

    from mm_adaptor.harness.runner.arguments import build_parser, finalize_args
    from mm_adaptor.harness.runner.model import build_model, transformer_config

    args = build_parser().parse_args(["--num-layers", "3", "--nproc-per-node", "1", "--normalization", "RMSNorm",
                                      "--swiglu", "--position-embedding-type", "rope", *extra])
    finalize_args(args, 1)
    mm_adaptor.enable(args)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    return build_model(args, transformer_config(args), torch.device("cpu"))[0]


TOKENS = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(0))
POSITIONS = torch.arange(64).expand(2, 64)


def step(model, accountant=None):
    """One forward and backward; (bytes per module at the end of forward, gradients)."""
    import contextlib

    with accountant.hooks() if accountant else contextlib.nullcontext():
        loss = model(TOKENS, POSITIONS, None, labels=TOKENS).float().sum()
    per_module = accountant.bytes_per_module() if accountant else None
    if accountant:
        accountant.close()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return per_module, grads


def run(extra, steps=1, accounted=1):
    """`steps` steps; (bytes per module at the end of step `accounted`'s forward, its gradients, statistics)."""
    from mm_adaptor.devices.memory import SavedTensorAccountant

    model = build(extra)
    try:
        for number in range(1, steps + 1):
            if number == accounted:
                per_module, grads = step(model, SavedTensorAccountant([model]))
            else:
                step(model)
        return per_module, grads, get("swap-attention").statistics() if extra else None
    finally:
        mm_adaptor.disable()


@pytest.fixture(scope="module")
def unswapped():
    from gloo_rank import one_gloo_rank

    with one_gloo_rank():
        return run([])


@pytest.fixture
def rank(unswapped):
    from gloo_rank import one_gloo_rank

    with one_gloo_rank():
        yield


SWAPPED = ("input_layernorm", "self_attention", "pre_mlp_layernorm")
ALL = ["--swap-attention", "--swap-min-bytes", "0", "--swap-select", "all"]  # every layer, the last included
BLOCK_INPUT_BYTES = 64 * 2 * 64 * 4  # [seq, batch, hidden] fp32: the embedding's output, held by the model


def test_bit_for_bit_and_every_byte_accounted(unswapped, rank):
    off, grads_off, _ = unswapped
    on, grads_on, stats = run(ALL)
    assert grads_on.keys() == grads_off.keys()
    assert all(torch.equal(grads_on[k], grads_off[k]) for k in grads_off)
    for layer in ("layer 1", "layer 2", "layer 3"):
        kept = BLOCK_INPUT_BYTES if layer == "layer 1" else 0
        assert sum(on[layer][m]["device"] for m in SWAPPED) == kept, (layer, on[layer])
        assert sum(on[layer][m]["host"] for m in SWAPPED) == sum(off[layer][m]["device"] for m in SWAPPED) - kept
        assert on[layer]["mlp"] == off[layer]["mlp"], "the MLP is not swapped"
    assert stats["kept_shared_bytes"] == BLOCK_INPUT_BYTES
    assert stats["offloaded_bytes"] == sum(on[layer][m]["host"] for layer in on if layer.startswith("layer")
                                           for m in SWAPPED)
    assert stats.get("fetched_on_demand", 0) == 0 and stats["prefetched"] > 0


def test_min_bytes_keeps_small_storages_on_the_device(unswapped, rank):
    from mm_adaptor.feature_flags.swap_attention import DEFAULT_MIN_BYTES

    off, grads_off, _ = unswapped
    on, grads_on, stats = run(["--swap-attention", "--swap-select", "all"])
    assert all(torch.equal(grads_on[k], grads_off[k]) for k in grads_off)
    # the tiny model saves [seq, batch, hidden] fp32 (32 KiB) tensors below the default: only larger ones move
    assert 0 < stats["offloaded_bytes"]
    assert sum(on["layer 2"][m]["device"] for m in SWAPPED) >= BLOCK_INPUT_BYTES
    assert DEFAULT_MIN_BYTES > BLOCK_INPUT_BYTES


def test_prefetch_runs_distance_layers_ahead_and_pool_is_reused(unswapped, rank, monkeypatch):
    from mm_adaptor.patches.transformer import swap_attention as sa

    events = []
    prefetch, unpack = sa.StoredStorage.prefetch, sa.SwappedTensor.unpack

    def logged_prefetch(self, on_demand=False):
        if self.state == "host":
            events.append(("prefetch", self.layer.layer_number))
        return prefetch(self, on_demand)

    def logged_unpack(self):
        events.append(("unpack", self.stored.layer.layer_number))
        return unpack(self)

    monkeypatch.setattr(sa.StoredStorage, "prefetch", logged_prefetch)
    monkeypatch.setattr(sa.SwappedTensor, "unpack", logged_unpack)
    _, grads, stats = run([*ALL, "--swap-prefetch-distance", "1"], steps=2)
    first_step = events[:events.index(("unpack", 1)) + 1]
    order = [e for i, e in enumerate(first_step) if e[0] == "prefetch" and e not in first_step[:i]]
    assert order == [("prefetch", 3), ("prefetch", 2), ("prefetch", 1)]
    # layer L comes back before any of L's own tensors is unpacked, and L - 1 when L's backward starts
    for layer in (3, 2, 1):
        assert first_step.index(("prefetch", layer)) < first_step.index(("unpack", layer))
    assert first_step.index(("prefetch", 1)) < first_step.index(("unpack", 2))
    assert stats["host_pool_bytes"] == stats["offloaded_bytes"] // 2, "the second step reused the first's buffers"


def test_unpack_fetches_on_demand_when_no_prefetch_came(unswapped, rank, monkeypatch):
    from mm_adaptor.patches.transformer import swap_attention as sa

    monkeypatch.setattr(sa.SwapManager, "_backward_starts", lambda *args: None)
    _, grads_off = unswapped[:2]
    _, grads_on, stats = run(ALL)
    assert all(torch.equal(grads_on[k], grads_off[k]) for k in grads_off)
    assert stats.get("prefetched", 0) == 0 and stats["fetched_on_demand"] > 0


# the bandwidth selection (the default) on the model: measured in the first two steps, chosen from the third


def host_per_layer(per_module):
    return {layer: sum(per_module[layer][m]["host"] for m in SWAPPED) for layer in ("layer 1", "layer 2", "layer 3")}


def test_bandwidth_selection_measures_every_layer_but_the_last_then_keeps_what_the_link_cannot_hide(
        unswapped, rank, monkeypatch):
    """Stand-in times: the link carries 1 MB per ms; layer 2's forward (layer 1's window) is far too short for layer
    1's copy, layer 3's (layer 2's window) long enough; layer 3 is the block's last."""
    from mm_adaptor.patches.transformer import swap_attention as sa

    seen = []

    def stand_in(measured):
        seen.append([(layer.number, layer.copied_bytes, layer.last) for layer in measured.layers])
        windows = {1: 1e-9, 2: 1e9, 3: 1e9}
        return [sa.LayerTiming(layer.number, windows[layer.number], layer.copied_bytes, layer.copied_bytes / 1e6,
                               layer.last) for layer in measured.layers]

    monkeypatch.setattr(sa, "device_timings", stand_in)
    _, grads_off, _ = unswapped
    flags = ["--swap-attention", "--swap-min-bytes", "0"]
    first, _, _ = run(flags, steps=1)
    assert host_per_layer(first)["layer 3"] == 0, "the last layer is never swapped, not even while measuring"
    assert host_per_layer(first)["layer 1"] > 0 and host_per_layer(first)["layer 2"] > 0
    third, grads_on, stats = run(flags, steps=3, accounted=3)
    assert all(torch.equal(grads_on[k], grads_off[k]) for k in grads_off)
    assert host_per_layer(third) == {"layer 1": 0, "layer 2": host_per_layer(first)["layer 2"], "layer 3": 0}
    numbers, copied, last = zip(*seen[-1])
    assert numbers == (1, 2, 3) and last == (False, False, True) and copied[0] > 0 and copied[2] == 0
    assert stats["select"] == "bandwidth" and stats["selection_pending"] == 0
    assert (stats["layers_swapped"], stats["layers"]) == (1, 3)
    assert stats["link_gb_per_s"] == 1.0, "bytes over the stand-in's time: 1 MB per ms"


def test_bandwidth_selection_on_the_cpu_clock_keeps_the_last_layer(unswapped, rank):
    """The CPU backend times copies and layers with the host clock (a stand-in for device events: the copies are
    synchronous and the 'host' is the same RAM): whatever it chooses, the gradients are the same bits and the last
    layer stays."""
    _, grads_off, _ = unswapped
    third, grads_on, stats = run(["--swap-attention", "--swap-min-bytes", "0"], steps=3, accounted=3)
    assert all(torch.equal(grads_on[k], grads_off[k]) for k in grads_off)
    assert host_per_layer(third)["layer 3"] == 0
    assert stats["layers"] == 3 and stats["layers_swapped"] <= 2 and stats["selection_pending"] == 0
    assert stats["link_gb_per_s"] > 0


def test_select_all_swaps_the_last_layer_too_and_reports_the_link(unswapped, rank):
    on, _, stats = run(ALL, steps=2)
    assert all(host_per_layer(on).values())
    assert stats["select"] == "all" and (stats["layers_swapped"], stats["layers"]) == (3, 3)
    assert stats["link_gb_per_s"] > 0 and stats["selection_pending"] == 0


# stream safety, with a backend whose streams record who wrote which buffer (the CPU's are no-ops)


class RecordingStream:
    def __init__(self, name):
        self.name = name

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def __repr__(self):
        return self.name


class RecordingEvent:
    def record(self, stream=None):
        pass


class RecordingBackend:
    """A GPU-like backend on CPU tensors: streams are named, copies and record_stream calls are logged."""

    name = "recording"

    def __init__(self):
        self.compute = RecordingStream("compute")
        self.streams = [self.compute]
        self.current = [self.compute]
        self.writes = []  # (data_ptr written, stream)
        self.recorded = []  # (data_ptr, stream) given to record_stream

    def torch_device(self):
        return torch.device("cpu")

    def new_stream(self):
        self.streams.append(RecordingStream(f"side{len(self.streams)}"))
        return self.streams[-1]

    def new_event(self):
        return RecordingEvent()

    def current_stream(self):
        return self.current[-1]

    def use_stream(self, stream):
        import contextlib

        @contextlib.contextmanager
        def on():
            self.current.append(stream)
            try:
                yield
            finally:
                self.current.pop()
        return on()

    def host_buffer(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)


def test_buffers_written_on_a_side_stream_are_recorded_on_it(monkeypatch):
    from mm_adaptor.patches.transformer import swap_attention as sa

    backend = RecordingBackend()
    copy = torch.Tensor.copy_

    def logged_copy(self, src, non_blocking=False):
        backend.writes.append((self.data_ptr(), backend.current_stream()))
        return copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: backend.recorded.append((self.data_ptr(), stream)))
    manager = sa.SwapManager()
    manager.use_backend(backend)
    layer = sa.LayerPass(sa.BlockPass(0), 1, set())
    saved = torch.arange(256, dtype=torch.float32)
    stored = sa.StoredStorage(manager, saved.untyped_storage(), layer)
    device_ptr = saved.data_ptr()
    stored.offload()
    assert (device_ptr, manager.offload_stream) in backend.recorded, "the offload copy reads it on its stream"
    del saved
    stored.release()
    assert stored.state == "host"
    stored.prefetch()
    restored_ptr = stored.restored.data_ptr()
    assert backend.writes[-1] == (restored_ptr, manager.prefetch_stream), "the copy back runs on the side stream"
    assert (restored_ptr, manager.prefetch_stream) in backend.recorded, \
        "a restored buffer freed before unpack could be reused while the prefetch copy still writes it"
    assert torch.equal(torch.empty(0).set_(stored.storage_for_unpack()), torch.arange(256, dtype=torch.float32))
