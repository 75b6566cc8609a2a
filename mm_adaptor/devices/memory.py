"""Memory accounting for feature comparisons: activation bytes saved for backward, per layer, as they stand
at the end of forward (storage released by a feature counts as freed), plus the bytes of parameters, gradients and
optimizer state, per kind, on the device and parked in host memory."""

from __future__ import annotations

import contextlib

import torch

from mm_adaptor.core.wrapped import unwrap


def peak_bytes(device) -> int:
    """The device allocator's peak (CUDA, NPU); on the CPU, which has none, this process's peak resident set
    (VmHWM)."""
    device = torch.device(device)
    if device.type == "cpu":
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
    return int(getattr(torch, device.type).max_memory_allocated(device))


def _storage_key(t: torch.Tensor):
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


# Accountants measuring now. A feature that packs saved tensors itself (its own saved_tensors_hooks shadow the
# accountant's) reports each packed object here; one with memory_residence() says where its bytes are.
_observers: list["SavedTensorAccountant"] = []


def notify_saved(packed) -> None:
    for accountant in _observers:
        accountant.record(packed)


class SavedTensorAccountant:
    """Attributes every tensor autograd saves during one forward to the transformer layer (and the layer's child
    module) running it, and reports the bytes left on the device and parked in host memory at the end."""

    OUTSIDE = "outside layers"

    def __init__(self, model_chunks):
        self.current = self.OUTSIDE
        self.current_module = ""
        self.saved: list[tuple[str, str, object]] = []
        self._handles = []
        self._param_storages = set()
        for chunk in model_chunks:
            model = unwrap(chunk)
            for p in model.parameters():
                self._param_storages.add(p.untyped_storage().data_ptr())
            for prefix, layer in self._layers(model):
                label = f"{prefix}layer {layer.layer_number}"
                self._handles.append(layer.register_forward_pre_hook(self._enter(label)))
                self._handles.append(layer.register_forward_hook(self._leave))
                for name, child in layer.named_children():
                    self._handles.append(child.register_forward_pre_hook(self._enter_module(name)))
                    self._handles.append(child.register_forward_hook(self._leave_module))

    @staticmethod
    def _layers(model):
        """(label prefix, layer) of a GPT's decoder, or a vision-language model's language and vision decoders."""
        towers = (("", model), ("", getattr(model, "language_model", None)),
                  ("vision ", getattr(model, "vision_model", None)))
        for prefix, tower in towers:
            for layer in getattr(getattr(tower, "decoder", None), "layers", []):
                yield prefix, layer

    def _enter(self, label):
        def hook(module, args):
            self.current = label

        return hook

    def _leave(self, module, args, output):
        self.current = self.OUTSIDE

    def _enter_module(self, name):
        def hook(module, args):
            self.current_module = name

        return hook

    def _leave_module(self, module, args, output):
        self.current_module = ""

    def record(self, packed):
        self.saved.append((self.current, self.current_module, packed))
        return packed

    @staticmethod
    def _unpack(t):
        return t

    @contextlib.contextmanager
    def hooks(self):
        _observers.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.record, self._unpack):
                yield
        finally:
            _observers.remove(self)

    def _residences(self):
        """(layer, module, residence, bytes) per distinct non-parameter storage (first saver wins)."""
        seen = set()
        for label, module, packed in self.saved:
            if hasattr(packed, "memory_residence"):
                residence, key, nbytes = packed.memory_residence()
            elif isinstance(packed, torch.Tensor) and packed.device.type != "meta":
                residence, key = "device", _storage_key(packed)
                nbytes = key[1]
                if key[0] in self._param_storages:
                    continue
            else:
                continue
            if key in seen:
                continue
            seen.add(key)
            yield label, module, residence, nbytes

    def bytes_per_layer(self, residence: str = "device") -> dict[str, int]:
        """Live bytes of the distinct non-parameter storages saved in each layer, in one residence."""
        totals: dict[str, int] = {}
        for label, _module, where, nbytes in self._residences():
            if where == residence:
                totals[label] = totals.get(label, 0) + nbytes
        return totals

    def bytes_per_module(self) -> dict[str, dict[str, dict[str, int]]]:
        """{layer: {child module: {residence: bytes}}}; "" for what a layer saves outside its children."""
        totals: dict = {}
        for label, module, where, nbytes in self._residences():
            cell = totals.setdefault(label, {}).setdefault(module, dict.fromkeys(RESIDENCES, 0))
            cell[where] += nbytes
        return totals

    def close(self):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.saved.clear()


# The kinds of model state, in the order that claims bytes: a byte counts once, for the first kind holding it
# (the fp32 main params of an fp32 run are the model parameters or views of them, so they add nothing).
STATE_KINDS = ("parameter_bytes", "gradient_bytes", "optimizer_main_param_bytes", "optimizer_moment_bytes")
RESIDENCES = ("device", "host")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte address of a tensor's elements: exactly its bytes when it is dense (parameters,
    gradient buffers and optimizer state are), the enclosing span for a strided view."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Bytes two merged span lists share."""
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _compute_device(model_chunks, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    from mm_adaptor import devices

    backend = devices.current()
    if backend is not None:
        return backend.torch_device()
    params = [p for c in model_chunks for p in unwrap(c).parameters() if p.device.type not in ("cpu", "meta")]
    return params[0].device if params else torch.device("cpu")


# A megatron optimizer whose main parameters or moments a feature keeps elsewhere than where the inner optimizer
# finds them between steps (released storage, residuals, host memory) has an object under this attribute whose
# state_tensors() lists (kind, residence, tensor) for everything it manages, kind being
# "optimizer_main_param_bytes" or "optimizer_moment_bytes".
STATE_HOLDER = "mm_adaptor_state_holder"


def _optimizer_state_tensors(optimizer):
    """(main params, moments) of a megatron optimizer (chained or not) or of a plain torch optimizer, as they are
    held now, each as (tensor, residence or None: where its device says). Scalars in the state (Adam's step
    counts) are not moments and are left out."""
    if optimizer is None:
        return [], []
    held = {"optimizer_main_param_bytes": [], "optimizer_moment_bytes": []}
    for outer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(outer, "optimizer", outer)
        holder = getattr(outer, STATE_HOLDER, None)
        covered = set()
        if holder is not None:
            for kind, residence, t in holder.state_tensors():
                held[kind].append((t, residence))
                covered.add(id(t))
        for group in inner.param_groups:
            for p in group["params"]:
                if id(p) not in covered and p.untyped_storage().nbytes():
                    held["optimizer_main_param_bytes"].append((p, None))
                held["optimizer_moment_bytes"] += [
                    (v, None) for v in inner.state.get(p, {}).values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and id(v) not in covered
                    and v.untyped_storage().nbytes()]
    return held["optimizer_main_param_bytes"], held["optimizer_moment_bytes"]


def model_state_bytes(model_chunks, optimizer=None, device=None) -> dict:
    """Bytes of parameters, gradients (DDP's main_grad buffers, or .grad), optimizer main params and optimizer
    moments, each per residence: "device" where the model computes, "host" for tensors parked in host memory
    (on the CPU while the model runs on an accelerator; on the CPU backend the host is the device).

    A tensor counts the bytes it spans; spans are merged per storage, so views of one contiguous buffer (megatron's
    DDP and distributed-optimizer buffers) count each view once, a parameter shared by two modules counts once and
    overlapping views do not double count. `device`: the model's compute device (default: the installed device
    backend's). Returns {kind: bytes} for STATE_KINDS, optimizer_state_bytes (main params + moments),
    device_bytes and host_bytes (all kinds), and by_residence {residence: {kind: bytes}}."""
    compute = _compute_device(model_chunks, device)
    params = [p for c in model_chunks for p in unwrap(c).parameters()]
    mains, moments = _optimizer_state_tensors(optimizer)
    grads = [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    grads += [t.grad for t, _ in mains if t.grad is not None]
    by_residence = {r: dict.fromkeys(STATE_KINDS, 0) for r in RESIDENCES}
    claimed: dict[tuple, list[tuple[int, int]]] = {}
    for kind, tensors in zip(STATE_KINDS, ([(p, None) for p in params], [(g, None) for g in grads], mains, moments)):
        spans: dict[tuple, list[tuple[int, int]]] = {}
        residences: dict[tuple, str] = {}
        for t, residence in tensors:
            if t.numel() and t.device.type != "meta":
                key = (t.device, t.untyped_storage().data_ptr())
                spans.setdefault(key, []).append(_byte_span(t))
                residences[key] = residence or ("host" if t.device.type == "cpu" and compute.type != "cpu"
                                                else "device")
        for key, storage_spans in spans.items():
            merged = _merge(storage_spans)
            new = sum(end - start for start, end in merged) - _overlap(merged, claimed.get(key, []))
            by_residence[residences[key]][kind] += new
            claimed[key] = _merge(claimed.get(key, []) + merged)
    totals = {kind: sum(by_residence[r][kind] for r in RESIDENCES) for kind in STATE_KINDS}
    return dict(totals,
                optimizer_state_bytes=totals["optimizer_main_param_bytes"] + totals["optimizer_moment_bytes"],
                device_bytes=sum(by_residence["device"].values()), host_bytes=sum(by_residence["host"].values()),
                by_residence=by_residence)
