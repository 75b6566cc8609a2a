"""--vpp-extra-warmup: one-line refusals, and the warm-up it asks of megatron's schedule (K more, clipped to the
virtual micro-batches there are; evaluation and stages already all in warm-up keep megatron's)."""

import argparse

import pytest

from refusals import assert_refused_in_one_line

from mm_adaptor.core.features import get
from mm_adaptor.patches.pipeline.vpp_extra_warmup import warmup_with_extra


def options(**kw):
    base = dict(vpp_extra_warmup=True, vpp_extra_warmup_microbatches=None, pipeline_model_parallel_size=2,
                num_layers=4, num_layers_per_virtual_pipeline_stage=1, virtual_pipeline_model_parallel_size=None,
                num_microbatches=4)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("kw,names", [
    (dict(vpp_extra_warmup=False, vpp_extra_warmup_microbatches=2), ["--vpp-extra-warmup-microbatches", "needs"]),
    (dict(vpp_extra_warmup_microbatches=0), ["--vpp-extra-warmup-microbatches 0"]),
    (dict(num_layers_per_virtual_pipeline_stage=None), ["--vpp-extra-warmup", "virtual pipeline"]),
    (dict(pipeline_model_parallel_size=1), ["--pipeline-model-parallel-size 2"]),
    (dict(overlap_moe_expert_parallel_comm=True), ["--overlap-moe-expert-parallel-comm"]),
    (dict(num_microbatches=2), ["2 micro-batches x 2 model chunks", "--global-batch-size"]),
])
def test_refusals_are_one_line_naming_the_flags(kw, names):
    assert_refused_in_one_line("vpp-extra-warmup", options(**kw), names)


def megatron(total, warmup):
    return lambda *args, **kwargs: (total, warmup >= total, min(warmup, total), total - min(warmup, total))


@pytest.mark.parametrize("extra,total,warmup,expected", [
    (1, 8, 4, (8, False, 5, 3)),
    (3, 8, 4, (8, False, 7, 1)),
    (5, 8, 4, (8, True, 8, 0)),  # clipped
    (1, 8, 8, (8, True, 8, 0)),  # already all in warm-up: megatron's
])
def test_warmup_length(extra, total, warmup, expected):
    assert warmup_with_extra(extra)(megatron(total, warmup), None, (4, 2, 2), {}) == expected


def test_evaluation_and_plain_pipelines_keep_megatrons_warmup():
    assert warmup_with_extra(1)(megatron(8, 4), None, (4, 2, 2), {"forward_only": True}) == (8, False, 4, 4)
    assert warmup_with_extra(1)(megatron(4, 1), None, (4, 1, 2), {}) == (4, False, 1, 3)


def megatron_lm_args(**kw):
    """Shaped like Megatron-LM's parsed and validated arguments: no num_microbatches (Megatron-LM keeps the count
    in its micro-batch calculator), the batch sizes and the parallel sizes instead."""
    base = dict(vpp_extra_warmup=True, vpp_extra_warmup_microbatches=None, world_size=8,
                tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=1,
                data_parallel_size=2, global_batch_size=8, micro_batch_size=2, rampup_batch_size=None, num_layers=4,
                num_layers_per_virtual_pipeline_stage=1, virtual_pipeline_model_parallel_size=2)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("kw,expected", [
    (dict(), 2),                                    # 8 / (2 x 2)
    (dict(data_parallel_size=None), 2),             # world 8 / (TP2 x PP2 x CP1) = DP 2
    (dict(data_parallel_size=None, context_parallel_size=2, global_batch_size=16), 8),  # DP 1
    (dict(rampup_batch_size=["4", "4", "100"]), None),  # the count changes during training
    (dict(global_batch_size=None), None),
])
def test_microbatches_from_megatron_lm_arguments(kw, expected):
    from mm_adaptor.feature_flags.vpp_extra_warmup import microbatches_per_step

    assert microbatches_per_step(megatron_lm_args(**kw)) == expected


def test_every_microbatch_in_warmup_is_refused_under_megatron_lm_arguments():
    args = megatron_lm_args()
    assert not hasattr(args, "num_microbatches")
    assert_refused_in_one_line("vpp-extra-warmup", args, ["2 micro-batches x 2 model chunks", "--global-batch-size"])
    get("vpp-extra-warmup").validate(megatron_lm_args(global_batch_size=32))  # 8 micro-batches: accepted


class DeviceClock:
    """A GPU-like backend: work advances a device clock the host never sees; events stamp it when recorded."""

    name = "fake-gpu"

    def __init__(self):
        self.now_ms, self.waits = 0.0, 0
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing, "a timing event"
                self.at = None

            def record(self, stream=None):
                self.at = clock.now_ms

            def synchronize(self):
                clock.waits += 1

            def elapsed_time(self, end):
                return end.at - self.at

        self.Event = Event

    def stream_module(self):
        return self


def test_pass_times_come_from_device_events_read_back_once_per_schedule(monkeypatch):
    from mm_adaptor.feature_flags.vpp_extra_warmup import VppExtraWarmup
    from mm_adaptor.patches.pipeline import vpp_extra_warmup as vw

    device = DeviceClock()
    in_flight = vw.InFlight()
    in_flight.backend = device
    monkeypatch.setattr(vw, "IN_FLIGHT", in_flight)

    def launch(ms):  # returns at once on the host; the device is busy for `ms`
        def kernel(*args, **kwargs):
            device.now_ms += ms
        return kernel

    for _ in range(3):
        vw.counting_forward(launch(7.0), None, (), {})
        vw.counting_backward(launch(11.0), None, (), {})
    assert device.waits == 0, "no pass waits for the device"
    vw.warmup_with_extra(1)(megatron(8, 4), None, (4, 2, 2), {})  # the next schedule reads the last one back
    assert device.waits == 6 and not in_flight.pending
    assert in_flight.mean_ms("forward") == 7.0 and in_flight.mean_ms("backward") == 11.0
    assert in_flight.clock == "fake-gpu timing events on the compute stream"
    stats = VppExtraWarmup().statistics()
    assert stats["mean forward ms per chunk"] == 7.0 and stats["chunk times measured with"] == in_flight.clock


def test_cpu_backend_pass_times_are_labelled_host_clock(monkeypatch):
    from mm_adaptor.devices.cpu import CpuBackend
    from mm_adaptor.patches.pipeline import vpp_extra_warmup as vw

    in_flight = vw.InFlight()
    in_flight.backend = CpuBackend()
    monkeypatch.setattr(vw, "IN_FLIGHT", in_flight)
    vw.counting_forward(lambda: sum(range(10000)), None, (), {})
    assert in_flight.mean_ms("forward") > 0 and in_flight.calls["forward"] == 1
    assert in_flight.clock.startswith("host clock")
