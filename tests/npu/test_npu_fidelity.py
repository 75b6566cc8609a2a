"""The NPU backend where torch_npu's rules differ from CUDA's, on a FAKE npu that keeps those rules: capability
reads (torch_npu answers None and, before 7.2.0, has no `major`), generators made at lazy initialisation, HCCL taking
npu tensors only and no float64, pinned host memory that says so, and the Megatron-LM options that need CUDA-only
APIs, refused in one line."""

import argparse

import pytest

from mm_adaptor.core.errors import ConfigurationError, one_line
from mm_adaptor.devices.npu import CUDA_ONLY_OPTIONS, NpuBackend
from tests.npu.fake import run_python

pytestmark = pytest.mark.npu

FIDELITY = r"""
import json, torch, torch_npu
import torch.distributed as dist

result = {"capability": torch.npu.get_device_capability(),
          "properties_have_major": hasattr(torch.npu.get_device_properties(), "major"),
          "generators_before_init": len(torch.npu.default_generators)}

# the fake's HCCL, one rank, before the backend is installed: no interception anywhere
dist.init_process_group("hccl", rank=0, world_size=1, store=dist.HashStore())
refusals = {}
for name, tensor in {"cpu": torch.ones(2), "float64": torch.ones(2, dtype=torch.float64, device="npu")}.items():
    try:
        dist.all_reduce(tensor)
        refusals[name] = None
    except Exception as exc:
        refusals[name] = str(exc)
result["hccl_refusals"] = refusals

from mm_adaptor import devices
devices.install("npu")
generators = torch.cuda.default_generators
result["cuda_generators"] = len(generators)
result["same_generator"] = generators[1] is torch.npu.default_generators[1]
result["cuda_capability"] = list(torch.cuda.get_device_capability())
result["megatron_arch_version"] = torch.cuda.get_device_properties(torch.device("cuda:0")).major
buffer = devices.current().host_buffer(64)
result["host_buffer_pinned"] = [buffer.is_pinned(), torch.ones(2).is_pinned()]
try:
    from megatron.training.utils import get_device_arch_version  # Megatron-LM's own read, where installed
    result["megatron_lm_arch_version"] = get_device_arch_version()
except ImportError:
    pass
print("RESULT=" + json.dumps(result))
"""


@pytest.fixture(scope="module")
def fidelity():
    return run_python(FIDELITY)


def test_the_fake_keeps_torch_npus_capability_generator_and_hccl_rules(fidelity):
    assert fidelity["capability"] is None and fidelity["properties_have_major"] is False
    assert fidelity["generators_before_init"] == 0
    assert "Tensors must be NPU and dense" in fidelity["hccl_refusals"]["cpu"]
    assert "float64" in fidelity["hccl_refusals"]["float64"]


def test_megatrons_capability_reads_answer_on_the_npu_backend(fidelity):
    # megatron asks ">= 8" (grouped GEMM, bf16) and ">= 10" (Blackwell-only settings): Ampere's answer
    assert fidelity["cuda_capability"] == [8, 0] and fidelity["megatron_arch_version"] == 8
    assert fidelity.get("megatron_lm_arch_version", 8) == 8


def test_pinned_host_buffers_report_as_pinned(fidelity):
    # swap-optimizer keeps a host buffer only while it is pinned: with a fake that never pins, that branch never ran
    assert fidelity["host_buffer_pinned"] == [True, False]


def test_cuda_generators_are_npus_generators_made_lazily(fidelity):
    assert fidelity["cuda_generators"] == 2 and fidelity["same_generator"] is True


@pytest.mark.parametrize("option", sorted(CUDA_ONLY_OPTIONS))
def test_cuda_only_megatron_options_are_refused_in_one_line(option):
    value = "local" if option == "cuda_graph_impl" else True
    with pytest.raises(ConfigurationError) as caught:
        NpuBackend().refuse_arguments(argparse.Namespace(**{option: value}))
    line = one_line(caught.value)
    assert line.startswith("mm_adaptor: error: --" + option.replace("_", "-")) and "\n" not in line
    assert "NPU backend does not provide" in line


def test_megatron_lms_defaults_are_not_refused():
    NpuBackend().refuse_arguments(argparse.Namespace(cuda_graph_impl="none", enable_cuda_graph=False, nccl_ub=False,
                                                     record_memory_history=False, nvtx_ranges=False))


def test_the_megatron_lm_hook_asks_the_backend(monkeypatch):
    from mm_adaptor import devices, megatron_lm

    monkeypatch.setattr(devices, "current", lambda: NpuBackend())
    with pytest.raises(ConfigurationError, match="--nvtx-ranges needs NVTX"):
        megatron_lm._check_device_serves(argparse.Namespace(nvtx_ranges=True, distributed_backend=None))


STREAMS = r"""
import json, torch, torch_npu

def copy_on_side_stream(wait):
    device, host = torch.arange(4.0, device="npu"), torch.empty(4, pin_memory=True)
    side = torch.npu.Stream()
    with torch.npu.stream(side):
        host.copy_(device, non_blocking=True)
        event = torch.npu.Event()
        event.record(side)
    if wait == "wait_stream":
        torch.npu.current_stream().wait_stream(side)
    elif wait == "wait_event":
        torch.npu.current_stream().wait_event(event)
    elif wait == "synchronize":
        torch.npu.synchronize()
    return host.tolist()

result = {wait: copy_on_side_stream(wait) for wait in ("none", "wait_stream", "wait_event", "synchronize")}
blocking = torch.empty(2, pin_memory=True)
with torch.npu.stream(torch.npu.Stream()):
    blocking.copy_(torch.ones(2, device="npu"))  # a blocking copy is complete on return
result["blocking"] = blocking.tolist()
print("RESULT=" + json.dumps(result))
"""


def test_a_copy_on_a_side_stream_is_complete_only_after_a_wait():
    result = run_python(STREAMS)
    assert all(x != x for x in result["none"]), result  # NaN: the forgotten wait shows
    for wait in ("wait_stream", "wait_event", "synchronize"):
        assert result[wait] == [0.0, 1.0, 2.0, 3.0], (wait, result[wait])
    assert result["blocking"] == [1.0, 1.0]
