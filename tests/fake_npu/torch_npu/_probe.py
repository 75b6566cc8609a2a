"""Test instrumentation of the FAKE torch_npu, off unless its environment variables are set.

MM_ADAPTOR_FAKE_NPU_PROBE=<dir>: after every optimizer step each rank writes <dir>/rank<N>.json: the devices of every
parameter, gradient, main_grad, buffer and optimizer state it can find, torch.cuda lazy calls still queued, and the
fake's counters (hccl calls, random draws, fp64 all-reduces, torch_npu op calls, copies deferred on side streams).
MM_ADAPTOR_FAKE_NPU_BREAK=rng|device|swap-wait: a deliberately broken NPU backend (its RNG redirect removed, or
device='cuda' left unmapped) or swap optimizer (its wait for the copies to host removed) that the tests must catch;
=composite: a broken fake (ops with a CPU kernel run their composite decomposition instead, see
torch_npu/__init__.py).
"""

from __future__ import annotations

import gc
import json
import os

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

PROBE_ENV = "MM_ADAPTOR_FAKE_NPU_PROBE"
BREAK_ENV = "MM_ADAPTOR_FAKE_NPU_BREAK"


def _devices(tensors) -> list[str]:
    return sorted({str(t.device.type) for t in tensors if isinstance(t, torch.Tensor)})


def _where(traceback_lines) -> str:
    """The frames that queued a torch.cuda lazy call, innermost last."""
    return " | ".join(line.strip().splitlines()[0] for line in (traceback_lines or [])[-4:])


def _snapshot(optimizer) -> dict:
    from torch_npu import _random, hccl, npu, ops

    params = [p for group in optimizer.param_groups for p in group["params"]]
    modules = [m for m in gc.get_objects() if isinstance(m, torch.nn.Module) and type(m).__name__ == "GPTModel"]
    model_params = [p for m in modules for p in m.parameters()]
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    try:
        from mm_adaptor.devices import npu as npu_backend

        fp64 = npu_backend.FP64_ALL_REDUCES["count"]
    except ImportError:
        fp64 = 0
    return {
        "optimizer_params": _devices(params),
        "model_params": _devices(model_params), "model_param_count": len(model_params),
        "grads": _devices([p.grad for p in model_params] + [getattr(p, "main_grad", None) for p in model_params]),
        "buffers": _devices([b for m in modules for b in m.buffers()]),
        "optimizer_states": _devices(states), "optimizer_state_count": len(states),
        # beyond the ones torch.cuda queues for itself on import
        "queued_cuda_lazy_calls": [_where(tb) for _call, tb in torch.cuda._queued_calls[_QUEUED_AT_IMPORT:]],
        "hccl_calls": dict(hccl.CALLS), "draws": dict(_random.DRAWS), "fp64_all_reduces": fp64,
        "npu_ops": dict(ops.CALLS), "deferred_copies": npu.DEFERRED["copies"],
    }


def _write_after_step(optimizer, args, kwargs):
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(os.environ[PROBE_ENV], f"rank{rank}.json"), "w") as f:
        json.dump(_snapshot(optimizer), f)


def _break_rng():
    import mm_adaptor.devices.npu as npu_backend

    npu_backend.rng_state_patches = lambda *args, **kwargs: None
    npu_backend.REDIRECTED = tuple(n for n in npu_backend.REDIRECTED if n != "_lazy_call")
    npu_backend.LazyGenerators = lambda: torch.cuda.default_generators  # left as torch.cuda's


def _break_swap_wait():
    from mm_adaptor.patches.optimizer import swap_optimizer

    swap_optimizer.SwappedOptimizerState.end_step = lambda self: None  # the copies to host are never waited for


def _break_device():
    import mm_adaptor.devices.redirect as redirect

    original = redirect.Target.device

    def leaves_cuda(self, dev):  # an unindexed 'cuda' string stays unmapped
        return torch.device("cuda") if dev == "cuda" else original(self, dev)

    redirect.Target.device = leaves_cuda


_QUEUED_AT_IMPORT = len(torch.cuda._queued_calls)


def install() -> None:
    if os.environ.get(PROBE_ENV):
        register_optimizer_step_post_hook(_write_after_step)
    broken = os.environ.get(BREAK_ENV)
    if broken == "rng":
        _break_rng()
    elif broken == "device":
        _break_device()
    elif broken == "swap-wait":
        _break_swap_wait()
    elif broken and broken != "composite":
        raise ValueError(f"{BREAK_ENV}={broken!r}: choose rng, device, swap-wait or composite")
