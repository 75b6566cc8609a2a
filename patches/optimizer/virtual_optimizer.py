"""--virtual-optimizer [GB]: Adam's moments live in host memory mapped into the device's address space
(ops.host_mapped_copy), read and written in place by the device's own Adam: no copy code in the step.

The moments appear at the first step; that step runs over batches of parameters (batched_step) and each batch's
new moments move to mapped memory right after their update, so they are never all on the device at once. With a
budget, moments go to host memory until it is full and the rest stay on the device. A moment replaced later (a
checkpoint load makes new tensors) is placed again before the next step.

The policy of the holder's "moments" slot (patches.optimizer.state_holder), so it composes with a main-parameter
policy (--reuse-fp32-param)."""

from __future__ import annotations

import torch

from mm_adaptor.patches.optimizer.state_holder import HolderPatches

FIRST_STEP_BATCH_BYTES = 256 * 2**20


class VirtualMoments:
    slots = ("moments",)
    releases_mains = False

    def __init__(self, optimizer, *, budget_bytes: float, place=None):
        from mm_adaptor.ops import host_mapped_copy

        self.inner = optimizer.optimizer
        self.params = [p for group in self.inner.param_groups for p in group["params"]]
        self.budget_bytes = budget_bytes
        self.place = place or host_mapped_copy
        self.mapped: dict[int, torch.Tensor] = {}  # id -> the mapped moment (kept alive here for the check)
        self.host_bytes = 0
        self.steps = 0

    def _moments(self, p):
        state = self.inner.state.get(p, {})
        return [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]

    def _place(self, params) -> None:
        for p in params:
            for key, moment in self._moments(p):
                if id(moment) in self.mapped:
                    continue
                nbytes = moment.numel() * moment.element_size()
                if self.host_bytes + nbytes > self.budget_bytes:
                    continue
                mapped = self.place(moment.detach())
                self.inner.state[p][key] = mapped
                self.mapped[id(mapped)] = mapped
                self.host_bytes += nbytes

    def _forget_replaced(self) -> None:
        current = {id(v) for p in self.params for _, v in self._moments(p)}
        for gone in [i for i in self.mapped if i not in current]:
            moment = self.mapped.pop(gone)
            self.host_bytes -= moment.numel() * moment.element_size()

    def needs_batched_step(self) -> bool:
        return any(not self._moments(p) for p in self.params)

    # -- the holder's step -------------------------------------------------------------------------------------
    def batch_limit(self):
        """Bounded batches while some moments do not exist yet (they are made on the device, then moved)."""
        return (FIRST_STEP_BATCH_BYTES, 8) if self.needs_batched_step() else None

    def begin_step(self, batches) -> None:
        self._batches = batches
        self._forget_replaced()
        self._place(self.params)

    def before(self, n) -> None:
        pass

    def after(self, n) -> None:
        self._place(self._batches[n])

    def end_step(self) -> None:
        self.steps += 1

    def state_tensors(self):
        return [("optimizer_moment_bytes", "host", m) for m in self.mapped.values()]

    def statistics(self) -> dict:
        return {"steps": self.steps, "moment_bytes_in_host_memory": self.host_bytes}


class Patches(HolderPatches):
    def make_policy(self, optimizer):
        return VirtualMoments(optimizer, **self.options)
