"""The CPU backend redirects megatron's CUDA assumptions and reverts exactly."""

import pytest
import torch

from mm_adaptor import devices
from mm_adaptor.devices.cpu import CpuBackend


UNPATCHED_IS_AVAILABLE = torch.cuda.is_available


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


class _AllocatesOnCudaInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2 + torch.zeros(grad.shape, device=torch.cuda.current_device())


class _BackwardInsideBackward(torch.autograd.Function):
    """What megatron's CheckpointFunction does: its backward reruns forward and calls torch.autograd.backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            y = _AllocatesOnCudaInBackward.apply(x)
        torch.autograd.backward(y, grad)
        return x.grad


def test_cuda_device_arguments_inside_a_backward_started_within_a_backward(backend):
    x = torch.ones(3, requires_grad=True)
    _BackwardInsideBackward.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_cuda_type_names_for_megatron_comparisons(backend):
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1).type("torch.cuda.HalfTensor").dtype == torch.float16


def test_torch_cuda_calls(backend):
    # left unpatched, so torch's own internals keep their paths (False on a CPU-only host, True beside a GPU)
    assert torch.cuda.is_available is UNPATCHED_IS_AVAILABLE
    assert "torch.cuda.is_available" not in backend.applied_targets()
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
    from mm_adaptor.ranks.launcher import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        assert dist.get_backend() == "gloo"
        group = dist.new_group([0], backend="nccl")
        assert dist.get_backend(group) == "gloo"
    finally:
        dist.destroy_process_group()


@pytest.fixture
def rendezvous(monkeypatch):
    from mm_adaptor.ranks.launcher import free_port

    monkeypatch.delenv("MM_ADAPTOR_DEVICE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    devices.uninstall()


def test_cpu_chosen_automatically_refuses_an_nccl_default_group(rendezvous):
    import torch.distributed as dist

    backend = devices.install()
    assert backend.name == "cpu" and backend.chosen_automatically
    with pytest.raises(devices.NoAcceleratorError) as refused:
        dist.init_process_group("nccl", rank=0, world_size=1)
    message = str(refused.value)
    assert "init_process_group(backend='nccl')" in message and "use backend='gloo'" in message
    assert "MM_ADAPTOR_DEVICE=cpu" in message and "\n" not in message
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1)  # the CPU on purpose
    group = dist.new_group([0], backend="nccl")  # megatron's subgroups follow a gloo default group
    assert dist.get_backend(group) == "gloo"


def test_default_backend_with_cpu_chosen_automatically_is_gloo(rendezvous):
    import torch.distributed as dist

    devices.install()
    dist.init_process_group(rank=0, world_size=1)  # no backend named: no accelerator asked for
    assert dist.get_backend() == "gloo"


def test_cpu_forced_by_the_environment_maps_nccl_to_gloo(rendezvous, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("MM_ADAPTOR_DEVICE", "cpu")
    backend = devices.install()
    assert not backend.chosen_automatically
    dist.init_process_group("nccl", rank=0, world_size=1)
    assert dist.get_backend() == "gloo"


def test_cpu_named_by_the_caller_is_chosen_on_purpose(rendezvous):
    backend = devices.install("cpu")
    assert not backend.chosen_automatically
    backend.check_distributed_backend("nccl", asked_by="x", how_to_choose_cpu="y")  # no error


def test_megatron_lm_nccl_default_is_refused_after_validation_with_cpu_chosen_automatically(rendezvous):
    import argparse

    from mm_adaptor.megatron_lm import _check_device_serves

    devices.install()
    expected = (r"--distributed-backend nccl \(Megatron-LM's default\) .*"
                r"pass --distributed-backend gloo or set MM_ADAPTOR_DEVICE=cpu")
    with pytest.raises(devices.NoAcceleratorError, match=expected):
        _check_device_serves(argparse.Namespace(distributed_backend="nccl"))
    _check_device_serves(argparse.Namespace(distributed_backend="gloo"))


def test_applied_lists_the_backend_patches(rendezvous):
    import mm_adaptor

    backend = devices.install()
    targets = mm_adaptor.applied()["backend:cpu"]
    assert "torch.cuda.current_device" in targets
    assert "megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu" in targets  # CPU-only now
    assert "megatron.core.models.common.embeddings.rope_utils.fused_apply_rotary_pos_emb" in targets
    assert "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__" in targets
    assert targets == backend.applied_targets() and mm_adaptor.applied_features() == {}


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
