"""CPU backend: megatron-core's CUDA assumptions redirected to the CPU (devices/redirect.py), NCCL to gloo.

What it changes, and nothing more:
- `torch.cuda` calls megatron makes (current device, RNG state, streams, events, synchronize,
  memory statistics, device properties, nvtx) get CPU equivalents; `torch.cuda.is_available()`
  stays False so torch's own internals keep their CPU paths.
- A torch function mode maps device arguments naming CUDA ('cuda', 'cuda:N', ints,
  torch.device('cuda')) to the CPU, makes `Tensor.cuda()`/`pin_memory()`/`record_stream()`
  no-ops and lets `Tensor.type()` answer with the CUDA type names megatron compares against.
- NCCL process groups become gloo, when the CPU was chosen on purpose (MM_ADAPTOR_DEVICE=cpu or
  devices.install("cpu")) or the default group is already gloo. Chosen only because no accelerator was
  found, an NCCL default group is refused with NoAcceleratorError: a GPU node whose driver is broken
  must not train on its host CPUs without a word.
- Megatron's CUDA RNG-state helpers use the CPU generator (what dropout on the CPU draws from), and
  MoE's split sizes, already on the host, honour as_numpy.
- Megatron-LM's "Megatron requires CUDA" check is lifted.
- Asynchronous sends take a copy of their tensor (megatron frees a pipeline output while its send may still be
  reading it, which gloo's background thread does not tolerate).
- gloo's missing collectives for uneven sizes (list all_gather, list reduce_scatter), which megatron's MoE uses
  under expert tensor parallelism, run as padded tensor collectives.

The torch.cuda stand-ins are in cpu_cuda.py, gloo's gaps in gloo.py; this module is the backend that installs
them, its process groups and its megatron patches.
"""

from __future__ import annotations

import torch

from mm_adaptor.devices.base import DeviceBackend, NoAcceleratorError, legacy_fused_kernels_present
from mm_adaptor.devices.cpu_cuda import CPU, CPU_ONLY, CPU_STREAMS, torch_cuda_patches
from mm_adaptor.devices.gloo import GLOO_SPECIALS
from mm_adaptor.devices.redirect import (Redirection, Target, names_nccl, new_group_request, process_group_request,
                                          rng_state_patches)
from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet


def cpu_target() -> Target:
    return Target("cpu", host_only=True, specials=GLOO_SPECIALS)


def _default_group_is_gloo() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "gloo"


def _move_split_sizes_to_host(tensor, as_numpy=False, record_stream=False):
    """megatron's maybe_move_tensor_to_cpu converts only CUDA tensors; host tensors must honour as_numpy too."""
    if torch.is_tensor(tensor):
        if tensor.device.type != "cpu":
            tensor = tensor.to(CPU, non_blocking=True)
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


CPU_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def _skip_cuda_kernel_build(args=None):
    return None


def _allow_no_cuda(wrapped, instance, args, kwargs):
    kwargs["allow_no_cuda"] = True
    return wrapped(*args, **kwargs)


def _megatron_core_patches() -> PatchSet:
    ps = PatchSet(
        "device:cpu:megatron-core", needed_on=CPU_ONLY,
        changes="megatron's CUDA RNG-state helpers use the CPU generator (what dropout draws from here); MoE's "
                "split sizes, already host tensors, honour maybe_move_tensor_to_cpu's as_numpy",
        unpatched="the RNG tracker's CUDA state calls fail without a GPU; megatron ignores as_numpy for host "
                  "tensors, so the MoE all-to-all dispatcher gets tensors where it expects numpy split sizes")
    # MoE's all-to-all split sizes are host tensors here; megatron converts them to numpy only from CUDA.
    ps.replace("megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu", _move_split_sizes_to_host,
               contract=Contract(versions=SUPPORTED_MEGATRON_CORE))
    rng_state_patches(ps, torch.get_rng_state, torch.set_rng_state, "the CPU backend")
    return ps


class CpuBackend(DeviceBackend):
    name = "cpu"
    bitwise_reproducible = True
    dist_backend = "gloo"

    def __init__(self) -> None:
        super().__init__()
        self._redirection: Redirection | None = None

    pins_host_memory = False  # the "host" copy is another CPU buffer: nothing to pin

    def torch_device(self) -> torch.device:
        return CPU

    def stream_module(self):
        return CPU_STREAMS

    def device_patch_sets(self):
        return [torch_cuda_patches(), self._process_group_patches(), _megatron_core_patches()]

    def _process_group_patches(self) -> PatchSet:
        ps = PatchSet(
            "device:cpu:process-groups", needed_on=CPU_ONLY,
            changes="NCCL process groups become gloo when the CPU was chosen on purpose (MM_ADAPTOR_DEVICE=cpu, "
                    "devices.install('cpu')) or the default group is gloo; chosen only because no accelerator was "
                    "found, an NCCL default group is refused with one line saying how to choose the CPU",
            unpatched="NCCL cannot start without a GPU")
        torch_versions = Contract(versions=">=2.4", package="torch")
        ps.wrap("torch.distributed.distributed_c10d.init_process_group", self._init_process_group_on_gloo,
                contract=torch_versions)
        ps.wrap("torch.distributed.distributed_c10d.new_group", self._new_group_on_gloo, contract=torch_versions)
        return ps

    def check_distributed_backend(self, requested, *, asked_by: str, how_to_choose_cpu: str) -> None:
        if not self.chosen_automatically or not names_nccl(requested):
            return
        raise NoAcceleratorError(
            f"{asked_by} asks for NVIDIA GPUs, but torch sees no CUDA device, so the CPU backend was chosen only "
            f"because no accelerator was found; to train on the CPU on purpose, {how_to_choose_cpu} or set "
            "MM_ADAPTOR_DEVICE=cpu (otherwise check the GPU driver, e.g. with nvidia-smi)")

    def _init_process_group_on_gloo(self, wrapped, instance, args, kwargs):
        requested = (args[0] if args else kwargs.get("backend"))
        self.check_distributed_backend(requested, how_to_choose_cpu="use backend='gloo'",
                                       asked_by=f"torch.distributed.init_process_group(backend={requested!r})")
        _, args, kwargs = process_group_request(args, kwargs, "gloo")
        return wrapped(*args, **kwargs)

    def _new_group_on_gloo(self, wrapped, instance, args, kwargs):
        requested = args[2] if len(args) >= 3 else kwargs.get("backend")
        if names_nccl(requested) and not _default_group_is_gloo():
            self.check_distributed_backend(requested, asked_by=f"torch.distributed.new_group(backend={requested!r})",
                                           how_to_choose_cpu="use backend='gloo'")
        _, args, kwargs = new_group_request(args, kwargs, "gloo")
        return wrapped(*args, **kwargs)

    def training_patch_sets(self):
        ps = PatchSet(
            "device:cpu:megatron-training", needed_on=CPU_ONLY,
            changes="Megatron-LM's 'Megatron requires CUDA' check is lifted and its legacy fused CUDA kernel build "
                    "skipped (where megatron.legacy still has one: core_v0.16)",
            unpatched="initialize_megatron asserts 'Megatron requires CUDA.'")
        contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
        ps.wrap("megatron.training.initialize.initialize_megatron", _allow_no_cuda, contract=contract)
        # Megatron-LM's legacy fused CUDA kernels (built with nvcc at start-up) cannot run on the CPU; 0.17+ has none.
        if legacy_fused_kernels_present():
            ps.replace("megatron.legacy.fused_kernels.load", _skip_cuda_kernel_build, contract=contract)
        return [ps]

    def _activate(self) -> None:
        self._redirection = Redirection(cpu_target(), CPU_ENV)
        self._redirection.enter()

    def _deactivate(self) -> None:
        if self._redirection is not None:
            self._redirection.exit()
            self._redirection = None

