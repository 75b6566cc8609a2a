"""--swap-optimizer's state machine on the CPU backend: between steps the main parameters and moments are their host
copies; the step fetches batch n + 1 before updating batch n, and gives the plain optimizer's values bit for bit."""

import pytest
import torch

from plain_optimizer_step import plain_step_on_shared_grads

from mm_adaptor import devices
from mm_adaptor.patches.optimizer.state_holder import OptimizerStateHolder
from mm_adaptor.patches.optimizer.swap_optimizer import SwappedOptimizerState


class MegatronShell:
    """What SwappedOptimizerState reads from a DistributedOptimizer."""

    def __init__(self, mains, models, inner):
        self.optimizer = inner
        self.shard_fp32_from_float16_groups, self.shard_float16_groups = [mains], [models]


def shards(seed):
    g = torch.Generator().manual_seed(seed)
    models = [torch.randn(s, generator=g).to(torch.bfloat16) for s in [(32, 16), (100,), (8, 8)]]
    return models, [m.float().requires_grad_(True) for m in models]


@pytest.mark.parametrize("budget_bytes", [1, 2**30], ids=["one-param-batches", "one-batch"])
def test_swapped_step_matches_the_plain_optimizer(budget_bytes):
    models_ref, mains_ref = shards(0)
    models, mains = shards(0)
    ref = torch.optim.AdamW(mains_ref, lr=1e-2)
    state = SwappedOptimizerState(MegatronShell(mains, models, torch.optim.AdamW(mains, lr=1e-2)),
                                  budget_bytes=budget_bytes, backend=devices.make("cpu"))
    order = []
    holder = OptimizerStateHolder(state.inner)
    holder.adopt(state)
    model_of = {id(main): model for main, model in zip(mains, models)}
    fetch, inner_step = state._to_device, state.inner.step
    state._to_device = lambda tensors: (order.append(("fetch", len(tensors))), fetch(tensors))[1]
    state.inner.step = lambda: (order.append(("update", sum(len(g["params"]) for g in state.inner.param_groups))),
                                inner_step())[1]
    g = torch.Generator().manual_seed(1)
    previous_homes = None
    for step in range(3):
        state.release_mains_for_grads()
        plain_step_on_shared_grads(ref, mains_ref, mains, models_ref, g)
        order.clear()
        holder.step(model_of)
        for a, b in zip(models_ref, models):
            assert torch.equal(a, b)
        for a, b in zip(mains_ref, mains):
            assert torch.equal(a, b)
            assert torch.equal(ref.state[a]["exp_avg_sq"], state.inner.state[b]["exp_avg_sq"])
        homes = {id(t): t.data_ptr() for p in mains for t in state._swapped(p)}
        if step:
            assert homes == previous_homes, "each tensor goes back to the same host buffer every step"
        previous_homes = homes
    n = len(mains) if budget_bytes == 1 else 1
    assert [kind for kind, _ in order] == ["fetch"] + ["fetch", "update"] * (n - 1) + ["update"], \
        "batch n + 1 is on its way before batch n is updated"
    elements = sum(m.numel() for m in mains)
    assert state.statistics()["bytes_to_host"] == 3 * 12 * elements  # main + two moments, every step
    # the first step fetches the main parameters only: Adam makes the moments on the device
    assert state.statistics()["bytes_to_device"] == 4 * elements + 2 * 12 * elements


def test_main_parameters_are_host_copies_again_when_no_step_follows_prepare_grads():
    """Megatron hands each main parameter its gradient in prepare_grads; the step may not follow (an overflow, or
    megatron-core 0.19's ChainedOptimizer skipping the update above grad_norm_skip_threshold), and a checkpoint
    saved then reads the main parameters: they are their host copies, with the values they had."""
    from mm_adaptor.devices.memory import STATE_HOLDER
    from mm_adaptor.patches.optimizer.swap_optimizer import Patches

    models_ref, mains_ref = shards(0)
    models, mains = shards(0)
    ref = torch.optim.AdamW(mains_ref, lr=1e-2)
    shell = MegatronShell(mains, models, torch.optim.AdamW(mains, lr=1e-2))
    state = SwappedOptimizerState(shell, budget_bytes=1, backend=devices.make("cpu"))
    holder = OptimizerStateHolder(state.inner)
    holder.adopt(state)
    setattr(shell, STATE_HOLDER, holder)
    homes = [m.data_ptr() for m in mains]
    g = torch.Generator().manual_seed(1)

    def megatron_prepare_grads(*_):
        assert all(m.untyped_storage().nbytes() == 0 for m in mains), "released while megatron hands the grads"
        plain_step_on_shared_grads(torch.optim.SGD(mains_ref, lr=0.0), mains_ref, mains, [], g)
        return False

    for skipped in (True, False):
        assert Patches.prepare_grads(megatron_prepare_grads, shell, (), {}) is False
        assert [m.data_ptr() for m in mains] == homes and not state.released, "host copies again"
        for a, b in zip(mains_ref, mains):
            assert torch.equal(a, b)
        if not skipped:
            ref.step()
            for model, main in zip(models_ref, mains_ref):
                model.copy_(main.detach())
            holder.step({id(main): model for main, model in zip(mains, models)})
    for a, b, ma, mb in zip(mains_ref, mains, models_ref, models):
        assert torch.equal(a, b) and torch.equal(ma, mb)
        assert torch.equal(ref.state[a]["exp_avg"], state.inner.state[b]["exp_avg"])
