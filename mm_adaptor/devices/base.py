"""What every device backend provides."""

from __future__ import annotations

import torch
import wrapt

from mm_adaptor.core.errors import ConfigurationError
from mm_adaptor.core.patching import PatchSet, apply_all


def legacy_fused_kernels_present() -> bool:
    """Megatron-LM up to core_v0.16 builds megatron.legacy.fused_kernels at start-up; 0.17+ removed the package (and
    _compile_dependencies no longer loads it), so there is nothing to skip there."""
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.legacy.fused_kernels") is not None
    except ModuleNotFoundError:  # megatron.legacy itself is gone
        return False


class NoAcceleratorError(ConfigurationError, RuntimeError):
    """An accelerator was asked for (e.g. NCCL) but none was found, and nobody chose the CPU on purpose."""


def compat_patch_sets() -> list[PatchSet]:
    """Fixes megatron-core needs on every device when Transformer Engine / Apex are absent."""
    from mm_adaptor.devices import megatron_compat

    return megatron_compat.every_device_patch_sets()


class DeviceBackend:
    """Adapts torch/megatron to one device type. Subclasses fill in the patch sets."""

    name = "base"
    dist_backend = "nccl"
    # Whether the same run on this device gives the same bits every time (the harness adds a repeat run to its noise
    # draws where it does not).
    bitwise_reproducible = False

    @property
    def verified_on_hardware(self) -> bool:
        """Whether the adaptor has been run and checked on this device (mm_adaptor.core.verification says where)."""
        from mm_adaptor.core import verification
        return verification.backend_verified(self.name)

    def __init__(self) -> None:
        self.reason = ""
        # True when chosen by probing the machine; False when MM_ADAPTOR_DEVICE or the caller named it.
        self.chosen_automatically = False
        self.installed = False
        self._core_patches: list[PatchSet] = []
        self._training_patches: list[PatchSet] = []
        self._training_hook_registered = False

    # Subclasses override these three.
    def torch_device(self) -> torch.device:
        raise NotImplementedError

    def set_local_device(self, local_rank: int) -> None:
        """Bind this process to the device of its local rank (where there is one per rank)."""

    def devices_per_node(self) -> int | None:
        """How many ranks one node can run, one device each; None where ranks share the host (CPU)."""
        return None

    def ranks_per_node_problem(self, ranks: int) -> str | None:
        """Why `ranks` ranks cannot run on this node (the collective library wants one device per rank)."""
        available = self.devices_per_node()
        if available is None or ranks <= available:
            return None
        return (f"{ranks} ranks on this node need {ranks} {self.name.upper()} devices (one per rank for "
                f"{self.dist_backend.upper()}), but torch sees {available}: use --nproc-per-node {available} or "
                f"fewer (mm-adaptor check: --layout single runs on one device)")

    # Side streams for copies that overlap compute (swap attention): the device module's own Stream, Event,
    # current_stream and stream context; the CPU backend's are no-ops, its work being ordered already.
    def stream_module(self):
        raise NotImplementedError

    def new_stream(self):
        return self.stream_module().Stream()

    def new_event(self):
        return self.stream_module().Event()

    def current_stream(self):
        return self.stream_module().current_stream()

    def use_stream(self, stream):
        """Context manager: work issued inside runs on `stream`."""
        return self.stream_module().stream(stream)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer device copies can read and write asynchronously (pinned where that exists)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pins_host_memory)

    pins_host_memory = True

    def core_patch_sets(self) -> list[PatchSet]:
        """Patches applied at install time (torch and megatron.core): the device's own, then the compat fixes."""
        return [*self.device_patch_sets(), *compat_patch_sets()]

    def device_patch_sets(self) -> list[PatchSet]:
        return []

    def training_patch_sets(self) -> list[PatchSet]:
        """Patches applied when megatron.training.initialize is imported (Megatron-LM)."""
        return []

    def describe(self) -> str:
        return f"{self.name}: {self.reason}"

    def check_distributed_backend(self, requested, *, asked_by: str, how_to_choose_cpu: str) -> None:
        """Raise NoAcceleratorError when `requested` (a process-group backend, named by `asked_by`) needs a
        device this backend was not chosen to replace; `how_to_choose_cpu` is the caller's own way out."""

    def barrier(self) -> None:
        """dist.barrier on this rank's device, named (torch warns when it has to guess an accelerator's)."""
        import torch.distributed as dist

        device = self.torch_device()
        if device.type == "cpu" or device.index is None:
            dist.barrier()
        else:
            dist.barrier(device_ids=[device.index])

    def refuse_arguments(self, args) -> None:
        """Raise ConfigurationError (one line, naming the flag) for a Megatron-LM option this device cannot serve."""

    def install(self) -> None:
        if self.installed:
            return
        self._core_patches = self.core_patch_sets()
        apply_all(self._core_patches)
        try:
            self._activate()
        except BaseException:
            for patch_set in reversed(self._core_patches):
                patch_set.revert()
            raise
        self.installed = True
        if not self._training_hook_registered:
            wrapt.register_post_import_hook(self._on_training_import, "megatron.training.initialize")
            self._training_hook_registered = True

    def uninstall(self) -> None:
        if not self.installed:
            return
        for patch_set in reversed(self._training_patches):
            patch_set.revert()
        self._training_patches = []
        self._deactivate()
        for patch_set in reversed(self._core_patches):
            patch_set.revert()
        self._core_patches = []
        self.installed = False

    def _on_training_import(self, _module) -> None:
        if not self.installed or self._training_patches:
            return
        sets = self.training_patch_sets()
        apply_all(sets)
        self._training_patches.extend(sets)

    def _activate(self) -> None:
        """Backend-specific process state beyond patches (e.g. a torch function mode)."""

    def _deactivate(self) -> None:
        pass

    def all_patch_sets(self) -> list[PatchSet]:
        return [*self._core_patches, *self._training_patches]

    def applied_targets(self) -> list[str]:
        """Every target this backend has patched now: its device patches and the compatibility patches."""
        return [patch.target for patch_set in self.all_patch_sets() for patch in patch_set if patch.applied]
