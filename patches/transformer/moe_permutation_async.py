"""--moe-permutation-async-comm: megatron's MoE token permutation and unpermutation on a side stream of the backend
(CUDA, NPU). The CPU backend applies none of it (feature_flags/moe_permutation_async.py)."""

from __future__ import annotations

import torch


class SidePermutation:
    """megatron's permute / unpermute (the token dispatcher's) run on a side stream of the backend: the side stream
    waits for the current one (the inputs), the current one waits for the side stream's event before anything uses
    the outputs, and the outputs are recorded on the side stream for the caching allocator."""

    def __init__(self, counts, backend=None):
        self.backend, self.counts = backend, counts
        self.stream = None

    def wrapper(self, name: str):
        def wrapped_call(wrapped, instance, args, kwargs):
            if self.backend is None:
                from mm_adaptor import devices

                self.backend = devices.current_or_chosen()
            backend = self.backend
            if self.stream is None:
                self.stream = backend.new_stream()
            current = backend.current_stream()
            self.stream.wait_stream(current)
            with backend.use_stream(self.stream):
                result = wrapped(*args, **kwargs)
                done = backend.new_event()
                done.record(self.stream)
            current.wait_event(done)
            for t in _tensors(result):
                t.record_stream(self.stream)
            self.counts[f"{name} runs on a side stream"] += 1
            return result

        return wrapped_call


def _tensors(result):
    items = result if isinstance(result, tuple) else (result,)
    return [t for t in items if isinstance(t, torch.Tensor)]
