"""Memory accounting for feature comparisons: activation bytes saved for backward, per layer, as they stand
at the end of forward (storage released by a feature counts as freed), plus parameter and optimizer-state bytes."""

from __future__ import annotations

import torch


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _storage_key(t: torch.Tensor):
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class SavedTensorAccountant:
    """Attributes every tensor autograd saves during one forward to the transformer layer running it."""

    OUTSIDE = "outside layers"

    def __init__(self, model_chunks):
        self.current = self.OUTSIDE
        self.saved: list[tuple[str, torch.Tensor]] = []
        self._handles = []
        self._param_storages = set()
        for chunk in model_chunks:
            model = _unwrap(chunk)
            for p in model.parameters():
                self._param_storages.add(p.untyped_storage().data_ptr())
            decoder = getattr(model, "decoder", None)
            for layer in getattr(decoder, "layers", []):
                label = f"layer {layer.layer_number}"
                self._handles.append(layer.register_forward_pre_hook(self._enter(label)))
                self._handles.append(layer.register_forward_hook(self._leave))

    def _enter(self, label):
        def hook(module, args):
            self.current = label

        return hook

    def _leave(self, module, args, output):
        self.current = self.OUTSIDE

    def _pack(self, t):
        self.saved.append((self.current, t))
        return t

    @staticmethod
    def _unpack(t):
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def bytes_per_layer(self) -> dict[str, int]:
        """Live bytes of the distinct non-parameter storages saved in each layer (first saver wins)."""
        seen = set()
        totals: dict[str, int] = {}
        for label, t in self.saved:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            ptr, nbytes = _storage_key(t)
            if ptr in self._param_storages or (ptr, nbytes) in seen:
                continue
            seen.add((ptr, nbytes))
            totals[label] = totals.get(label, 0) + nbytes
        return totals

    def close(self):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.saved.clear()


def parameter_bytes(model_chunks) -> int:
    seen = set()
    total = 0
    for chunk in model_chunks:
        for p in _unwrap(chunk).parameters():
            key = _storage_key(p)
            if key not in seen:
                seen.add(key)
                total += p.numel() * p.element_size()
    return total


def optimizer_state_bytes(optimizer, model_chunks) -> int:
    """Optimizer moments plus any main (fp32) parameter copies that are not the model parameters themselves."""
    model_storages = {p.untyped_storage().data_ptr() for c in model_chunks for p in _unwrap(c).parameters()}
    inners = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    total = 0
    for inner in inners:
        for group in inner.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in model_storages:
                    total += p.numel() * p.element_size()
                for value in inner.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        total += value.numel() * value.element_size()
    return total
