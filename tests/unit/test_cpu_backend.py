"""The CPU backend redirects megatron's CUDA assumptions and reverts exactly."""

import pytest
import torch

from mm_adaptor import devices
from mm_adaptor.devices.cpu import CpuBackend


@pytest.fixture
def backend():
    assert devices.current() is None
    installed = devices.install("cpu")
    yield installed
    devices.uninstall()


def test_device_arguments_naming_cuda_land_on_cpu(backend):
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
    t = torch.ones(3)
    assert t.cuda() is t
    assert t.to("cuda").device.type == "cpu" and t.to(device=0).device.type == "cpu"
    assert torch.ones(2, pin_memory=True).device.type == "cpu"


def test_cuda_type_names_for_megatron_comparisons(backend):
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1).type("torch.cuda.HalfTensor").dtype == torch.float16


def test_torch_cuda_calls(backend):
    assert torch.cuda.is_available() is False  # torch's own internals keep their CPU paths
    assert torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    torch.cuda.synchronize()
    assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
    assert torch.cuda.memory_allocated() == 0
    assert torch.cuda.get_device_properties().total_memory > 0
    torch.cuda.nvtx.range_push("x")
    torch.cuda.nvtx.range_pop()


def test_cuda_rng_is_the_cpu_generator(backend):
    from megatron.core.tensor_parallel.random import _get_cuda_rng_state, _set_cuda_rng_state

    torch.cuda.manual_seed(7)
    state = _get_cuda_rng_state()
    a = torch.rand(4)
    _set_cuda_rng_state(state)
    assert torch.equal(a, torch.rand(4))
    assert torch.equal(torch.cuda.get_rng_state(), torch.get_rng_state())


def test_nccl_process_groups_become_gloo(backend, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    from mm_adaptor.launcher import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        assert dist.get_backend() == "gloo"
        group = dist.new_group([0], backend="nccl")
        assert dist.get_backend(group) == "gloo"
    finally:
        dist.destroy_process_group()


def test_uninstall_restores_torch_exactly():
    originals = {name: getattr(torch.cuda, name) for name in ("current_device", "Stream", "get_rng_state")}
    init_pg = torch.distributed.init_process_group
    devices.install("cpu")
    assert torch.cuda.current_device is not originals["current_device"]
    devices.uninstall()
    for name, obj in originals.items():
        assert getattr(torch.cuda, name) is obj, name
    assert torch.distributed.init_process_group is init_pg
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_backend_choice_can_be_forced(monkeypatch):
    monkeypatch.setenv("MM_ADAPTOR_DEVICE", "cpu")
    assert devices.choose() == ("cpu", "forced by MM_ADAPTOR_DEVICE=cpu")
    monkeypatch.setenv("MM_ADAPTOR_DEVICE", "tpu")
    with pytest.raises(ValueError, match="not a device backend"):
        devices.choose()
    monkeypatch.delenv("MM_ADAPTOR_DEVICE")
    assert devices.choose()[0] == "cpu"


def test_install_twice_is_idempotent():
    first = devices.install("cpu")
    try:
        assert devices.install() is first
        with pytest.raises(RuntimeError, match="already installed"):
            devices.install("cuda")
    finally:
        devices.uninstall()
    assert isinstance(first, CpuBackend)
