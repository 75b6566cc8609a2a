"""Ascend NPU backend through torch_npu: megatron's CUDA assumptions redirected to `npu` by the shared
interception layer (devices/redirect.py), NCCL to HCCL.

What it changes:
- the torch.cuda calls megatron makes (devices, RNG state, streams, events, memory statistics) go to torch.npu;
  `torch.cuda.is_available()` stays as torch answers it, so torch's own internals keep their paths;
- device arguments naming CUDA, `.cuda()`, `is_cuda` and the CUDA type names, through the shared torch function mode;
- megatron's CUDA RNG-state helpers read and write torch.npu's generator (megatron's own setter queues a
  torch.cuda lazy call that never runs on a CPU build of torch: TP ranks would draw different numbers);
- NCCL process groups (default or new_group) become HCCL, NCCL options dropped; float64 all-reduces, which HCCL
  refuses, run as an all-gather of their bits reduced locally in float64; `torch.distributed.is_nccl_available()`
  answers whether HCCL is there and `torch.distributed.ProcessGroupNCCL.Options` builds options HCCL groups drop
  (megatron's --nccl-communicator-config-path), both for callers outside torch only (see _PackageAttribute);
- megatron's torch.compile fuser runs eagerly (no NPU compiler backend is assumed), in every thread: the stance,
  not torch._dynamo.config.disable, whose value is per context and so unset in the autograd threads where the
  fused functions' backward runs;
- Megatron-LM: its CUDA check is lifted and its legacy fused CUDA kernels (core_v0.16) are not built, its signal
  handler's device is the NPU, CUDA_DEVICE_MAX_CONNECTIONS=1.
Run on the FAKE npu device in CI (tests/fake_npu); what only Ascend hardware can show: `mm-adaptor report`.
"""

from __future__ import annotations

import types
import warnings

import torch

from mm_adaptor.core.errors import ConfigurationError
from mm_adaptor.devices.base import DeviceBackend, legacy_fused_kernels_present
from mm_adaptor.devices.redirect import (Redirection, Target, new_group_request, process_group_request,
                                         rng_state_patches)
from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, Patch, PatchSet, bound_arguments

NPU_ONLY = "the NPU backend only"
REDIRECTED = (
    "current_device", "set_device", "device_count", "synchronize", "empty_cache", "get_rng_state",
    "set_rng_state", "manual_seed", "manual_seed_all", "Stream", "Event", "current_stream",
    "default_stream", "set_stream", "stream", "device", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats", "reset_max_memory_allocated",
    "memory_stats", "get_device_name", "_lazy_call",
)
NPU_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
# What megatron's capability reads get on an NPU, whose torch_npu answers get_device_capability() with None and,
# before torch_npu 7.2.0, has no `major` in its device properties: Ampere's (8, 0). megatron asks ">= 8" for what
# an Ascend 910 has (bf16, grouped GEMM) and ">= 10" (Blackwell) for what it has not (no need for
# CUDA_DEVICE_MAX_CONNECTIONS=1, high-priority NCCL streams).
MEGATRON_CAPABILITY = (8, 0)
# Megatron-LM options that need a CUDA-only API the NPU backend does not map: option -> (is it on?, what it needs)
CUDA_ONLY_OPTIONS = {
    "cuda_graph_impl": (lambda v: v not in (None, "none"), "CUDA graphs"),
    "enable_cuda_graph": (bool, "CUDA graphs"),
    "external_cuda_graph": (bool, "CUDA graphs"),
    "optimizer_cuda_graph": (bool, "CUDA graphs"),
    "nccl_ub": (bool, "torch.cuda.MemPool and use_mem_pool (NCCL user buffers)"),
    "record_memory_history": (bool, "torch.cuda.memory._record_memory_history"),
    "nvtx_ranges": (bool, "NVTX ranges (torch.cuda.nvtx)"),
}


def megatron_device_capability(device=None) -> tuple[int, int]:
    capability = torch.npu.get_device_capability(device)
    return tuple(capability) if capability else MEGATRON_CAPABILITY


def megatron_device_properties(device=None):
    """torch.npu's device properties with the `major`/`minor` megatron reads (get_device_arch_version)."""
    properties = torch.npu.get_device_properties(device)
    if hasattr(properties, "major"):
        return properties
    names = [n for n in dir(properties) if not n.startswith("_") and not callable(getattr(properties, n))]
    view = types.SimpleNamespace(**{n: getattr(properties, n) for n in names})
    view.major, view.minor = MEGATRON_CAPABILITY
    return view


class LazyGenerators(tuple):
    """torch.cuda.default_generators on the NPU backend: torch.npu's, looked up on each use. torch_npu leaves its
    tuple empty until lazy initialisation and then binds a new one, so a copy taken at install time stays empty."""

    def _current(self):
        torch.npu._lazy_init()
        return torch.npu.default_generators

    def __getitem__(self, index):
        return self._current()[index]

    def __len__(self):
        return len(self._current())

    def __iter__(self):
        return iter(self._current())

    def __bool__(self):
        return bool(self._current())

    def __repr__(self):
        return f"LazyGenerators({self._current()!r})"


def _npu_target() -> Target:
    return Target("npu", current_index=lambda: torch.npu.current_device(),
                  specials={torch.distributed.all_reduce: _all_reduce_fp64_as_bits})


def _on_hccl(group) -> bool:
    import torch.distributed as dist

    return dist.get_backend(group) == "hccl"


FP64_ALL_REDUCES = {"count": 0}  # how many float64 all-reduces took the bits path (tests assert it ran)


def _all_reduce_fp64_as_bits(func, args, kwargs):
    """HCCL has no float64 collectives: gather every rank's float64 bits (as int32 pairs) and reduce them here."""
    import torch.distributed as dist

    bound = bound_arguments(("tensor", "op", "group", "async_op"), args, kwargs)
    tensor, group = bound["tensor"], bound.get("group")
    op = bound.get("op", dist.ReduceOp.SUM)
    if tensor.dtype != torch.float64 or not _on_hccl(group) or bound.get("async_op"):
        return func(*args, **kwargs)
    reducers = {dist.ReduceOp.SUM: torch.sum, dist.ReduceOp.MAX: torch.amax, dist.ReduceOp.MIN: torch.amin,
                dist.ReduceOp.PRODUCT: torch.prod}
    if op not in reducers:
        return func(*args, **kwargs)
    FP64_ALL_REDUCES["count"] += 1
    bits = tensor.detach().contiguous().view(torch.int32).reshape(-1)
    gathered = bits.new_empty(dist.get_world_size(group) * bits.numel())
    dist.all_gather_into_tensor(gathered, bits, group=group)
    values = gathered.view(torch.float64).reshape(-1, *tensor.shape)
    tensor.copy_(reducers[op](values, dim=0))
    return None


class _PackageAttribute(Patch):
    """A replacement of a `torch.distributed` attribute for callers outside torch (megatron, user scripts): torch's own
    distributed_c10d keeps its binding. Its is_nccl_available() guards references to ProcessGroupNCCL, which
    the CPU build of torch that torch_npu runs on does not have."""

    def _prefixes(self, owner) -> tuple[str, ...]:
        return self.rebind_prefixes


def _is_nccl_available() -> bool:
    """On the NPU backend: whether the accelerator's collective library (HCCL) is there, so that code choosing
    backend='nccl' when this says yes gets HCCL (the backend maps the name)."""
    import torch.distributed as dist

    is_hccl_available = getattr(dist, "is_hccl_available", None)  # torch_npu adds it
    return bool(is_hccl_available()) if is_hccl_available is not None else "hccl" in dist.Backend.backend_list


NCCL_OPTIONS_WARNED = {"count": 0}


class _NcclOptions:
    """torch.distributed.ProcessGroupNCCL.Options on the NPU backend: megatron builds one per group named in
    --nccl-communicator-config-path. Its settings (CTAs, CGA cluster size, network, stream priority) have no HCCL
    counterpart: the HCCL group is created without them (new_group drops NCCL options), as the first one says."""

    def __init__(self, is_high_priority_stream: bool = False):
        self.is_high_priority_stream = is_high_priority_stream
        self.config = types.SimpleNamespace()
        if not NCCL_OPTIONS_WARNED["count"]:
            warnings.warn("NCCL communicator options (--nccl-communicator-config-path) have no HCCL counterpart on "
                          "the NPU backend: its process groups are created without them", RuntimeWarning,
                          stacklevel=2)
        NCCL_OPTIONS_WARNED["count"] += 1


class _ProcessGroupNccl:
    """Stands in for torch.distributed.ProcessGroupNCCL on the NPU backend: only its Options (see _NcclOptions)."""

    Options = _NcclOptions


def _signal_handler_device(local_rank=None):
    index = torch.npu.current_device() if local_rank is None else int(local_rank)
    return torch.device("npu", index)


def eager_everywhere(patch_set: PatchSet, contract: Contract) -> None:
    """torch.compile'd functions run eagerly in every thread. torch.compiler.set_stance("force_eager") is a process
    global; torch._dynamo.config.disable is a per-context value (a ContextVar in torch 2.13), unset in the autograd
    engine's device threads, where megatron's compiled backward functions (swiglu_back, ...) would still compile."""
    from torch._dynamo import eval_frame

    if hasattr(eval_frame, "_stance"):
        patch_set.replace("torch._dynamo.eval_frame._stance", eval_frame.DynamoStance(stance="force_eager"),
                          contract=contract)
    else:  # torch < 2.6 has no stance; its config is a plain module attribute there
        patch_set.replace("torch._dynamo.config.disable", True, contract=contract)


def _skip(*_args, **_kwargs):
    return None


def _allow_no_cuda(wrapped, instance, args, kwargs):
    kwargs["allow_no_cuda"] = True
    return wrapped(*args, **kwargs)


def _npu():
    """torch.npu, which exists once torch_npu is imported."""
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("the npu backend needs torch_npu (pip install torch-npu matching your torch)") from exc
    return torch.npu


class NpuBackend(DeviceBackend):
    name = "npu"
    dist_backend = "hccl"

    def __init__(self) -> None:
        super().__init__()
        self._redirection: Redirection | None = None

    def torch_device(self) -> torch.device:
        return torch.device("npu", _npu().current_device())

    def set_local_device(self, local_rank: int) -> None:
        _npu().set_device(local_rank % _npu().device_count())

    def devices_per_node(self) -> int:
        return _npu().device_count()

    def stream_module(self):
        return _npu()

    def device_patch_sets(self):
        _npu()
        torch_versions = Contract(versions=">=2.1", package="torch")
        calls = PatchSet("device:npu", needed_on=NPU_ONLY,
                         changes="the torch.cuda calls megatron makes go to torch.npu; torch.compile'd functions run "
                                 "eagerly in every thread (megatron's fuser has no NPU compiler backend here)",
                         unpatched="'Torch not compiled with CUDA enabled' from megatron's torch.cuda calls")
        for name in REDIRECTED:
            if hasattr(torch.npu, name):
                calls.replace(f"torch.cuda.{name}", getattr(torch.npu, name), contract=torch_versions)
        calls.replace("torch.cuda.default_generators", LazyGenerators(), contract=torch_versions)
        calls.replace("torch.cuda.get_device_capability", megatron_device_capability, contract=torch_versions)
        calls.replace("torch.cuda.get_device_properties", megatron_device_properties, contract=torch_versions)
        eager_everywhere(calls, torch_versions)
        groups = PatchSet("device:npu:process-groups", needed_on=NPU_ONLY,
                          changes="NCCL process groups (the default one and new_group's) become HCCL; "
                                  "is_nccl_available answers for HCCL and ProcessGroupNCCL.Options builds options "
                                  "the HCCL groups drop (for callers outside torch)",
                          unpatched="megatron's new_group(backend='nccl') fails on an NPU machine")
        groups.wrap("torch.distributed.distributed_c10d.init_process_group", _init_process_group_on_hccl,
                    contract=torch_versions)
        groups.wrap("torch.distributed.distributed_c10d.new_group", _new_group_on_hccl, contract=torch_versions)
        groups.add(_PackageAttribute("torch.distributed.is_nccl_available", _is_nccl_available, mode="replace",
                                     contract=torch_versions, feature=groups.name))
        groups.add(_PackageAttribute("torch.distributed.ProcessGroupNCCL", _ProcessGroupNccl, mode="replace",
                                     feature=groups.name, create=True))
        core = PatchSet("device:npu:megatron-core", needed_on=NPU_ONLY,
                        changes="megatron's CUDA RNG-state helpers use torch.npu's generator",
                        unpatched="megatron's RNG setter queues a torch.cuda lazy call that never runs: TP ranks "
                                  "draw different dropout masks and the RNG tracker does not restore states")
        rng_state_patches(core, lambda: torch.npu.get_rng_state(), lambda s: torch.npu.set_rng_state(s),
                          "the NPU backend")
        return [calls, groups, core]

    def training_patch_sets(self):
        ps = PatchSet("device:npu:megatron-training", needed_on=NPU_ONLY,
                      changes="Megatron-LM's CUDA check is lifted and its legacy fused CUDA kernel build skipped "
                              "(core_v0.16; the dataset index builder still compiles); its signal handler's device "
                              "is the NPU",
                      unpatched="initialize_megatron asserts 'Megatron requires CUDA.' and builds CUDA kernels")
        contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
        ps.wrap("megatron.training.initialize.initialize_megatron", _allow_no_cuda, contract=contract)
        if legacy_fused_kernels_present():  # megatron-core 0.17+ has no legacy fused kernels
            ps.replace("megatron.legacy.fused_kernels.load", _skip, contract=contract)
        ps.replace("megatron.training.dist_signal_handler.get_device", _signal_handler_device, contract=contract)
        return [ps]

    def refuse_arguments(self, args) -> None:
        for option, (is_on, needs) in CUDA_ONLY_OPTIONS.items():
            value = getattr(args, option, None)
            if is_on(value):
                flag = "--" + option.replace("_", "-") + ("" if isinstance(value, bool) else f" {value}")
                raise ConfigurationError(f"{flag} needs {needs}, which the NPU backend does not provide; "
                                         "remove it to train on Ascend NPUs")

    def _activate(self) -> None:
        self._redirection = Redirection(_npu_target(), NPU_ENV)
        self._redirection.enter()

    def _deactivate(self) -> None:
        if self._redirection is not None:
            self._redirection.exit()
            self._redirection = None


def _init_process_group_on_hccl(wrapped, instance, args, kwargs):
    _, args, kwargs = process_group_request(args, kwargs, "hccl")
    return wrapped(*args, **kwargs)


def _new_group_on_hccl(wrapped, instance, args, kwargs):
    _, args, kwargs = new_group_request(args, kwargs, "hccl")
    return wrapped(*args, **kwargs)
