"""--reuse-fp32-param on the installed megatron-core (0.17 or newer): bit for bit against unpatched Megatron with its
mechanism seen at work (main-parameter bytes halved), in the optimizers megatron builds there (a ChainedOptimizer
around the distributed optimizer or Float16OptimizerWithFloat16Params); checkpoints saved with it load without it
and the other way round; the broken variant fails; and the update megatron-core 0.19's ChainedOptimizer skips above
grad_norm_skip_threshold leaves the swapped main parameters in host memory. --swap-optimizer's and
--virtual-optimizer's checks, broken variants and checkpoints run on this release in
tests/distributed/test_optimizer_state_features.py (the newest leg runs tests/distributed)."""

import sys
from pathlib import Path

import pytest
import torch

from mm_adaptor import harness

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))  # broken variants, checkpoint runs
from checkpoint_directions import assert_checkpoints_load_both_ways  # noqa: E402

pytestmark = pytest.mark.distributed

ITERS = 4


def check(flags, layout, extra):
    result = harness.compare(flags, layout=layout, extra_args=list(extra), iters=ITERS)
    assert result.passed, harness.format_comparison(result)
    assert result.tolerance.exact
    return result


@pytest.mark.parametrize("layout,extra", [("tp2", ["--bf16"]),
                                          ("dp2-distopt", ["--bf16", "--overlap-param-gather"])],
                         ids=["tp2-float16-optimizer", "dp2-distributed-optimizer"])
def test_reuse_fp32_param_halves_the_main_parameters(layout, extra):
    result = check(["--reuse-fp32-param"], layout, extra)
    off, on = result.memory_off, result.memory_on
    stats = on["feature_statistics"]["reuse-fp32-param"]
    assert stats["steps"] == ITERS
    assert off["optimizer_main_param_bytes"] == 4 * stats["main_param_elements"] > 0
    assert on["optimizer_main_param_bytes"] == \
        2 * stats["main_param_elements"] + 12 * stats["exception_capacity"] + 8 * stats["main_params"]
    for kind in ("parameter_bytes", "gradient_bytes", "optimizer_moment_bytes"):
        assert on[kind] == off[kind], kind


def test_a_wrong_variant_fails():
    """The unpatched run is the check's above (cached)."""
    with harness.extra_feature_module("broken_reuse_fp32_param_feature"):
        result = harness.compare(["--use-test-reuse-fp32-param-losing-low-bits"], layout="tp2", extra_args=["--bf16"],
                                 iters=ITERS)
    assert not result.passed
    assert result.params.failures


def test_checkpoints_load_both_ways(tmp_path):
    assert_checkpoints_load_both_ways(tmp_path, "dp2-distopt", ["--reuse-fp32-param"], ["--bf16"])


def test_swapped_main_parameters_stay_in_host_memory_when_the_chained_optimizer_skips_the_update(
        single_rank_megatron):
    """grad_norm_skip_threshold (megatron-core 0.19): ChainedOptimizer.step runs prepare_grads, then skips
    step_with_ready_grads; the main parameters must be their host copies, unchanged, for whatever reads them
    next (a checkpoint save), and the next step updates them as unpatched Megatron does."""
    import argparse

    import mm_adaptor
    from mm_adaptor.devices.memory import STATE_HOLDER
    from mm_adaptor.harness.runner.arguments import finalize_args, parse_args
    from mm_adaptor.patches.optimizer.swap_optimizer import SwappedOptimizerState
    from mm_adaptor.harness.runner.model import build_model, build_optimizer, transformer_config, wrap_model

    def build(threshold):
        from megatron.core import tensor_parallel

        args = finalize_args(parse_args(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
                                         "--vocab-size", "128", "--seq-length", "16", "--bf16",
                                         "--use-distributed-optimizer"]), 1)
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        config = transformer_config(args)
        model = wrap_model(args, config, build_model(args, config, torch.device("cpu")))
        optimizer, _ = build_optimizer(args, config, model, grad_norm_skip_threshold=threshold)
        return model, optimizer

    def step(model, optimizer, seed):
        optimizer.zero_grad()
        g = torch.Generator().manual_seed(seed)
        for buffer in model[0].buffers:
            buffer.grad_data.copy_(torch.randn(buffer.grad_data.shape, generator=g))
        return optimizer.step()[0]

    def mains(optimizer):
        return [main for opt in optimizer.chained_optimizers
                for group in opt.shard_fp32_from_float16_groups for main in group]

    model_ref, optimizer_ref = build(float("inf"))
    before = [m.detach().clone() for m in mains(optimizer_ref)]
    assert step(model_ref, optimizer_ref, 1)
    mm_adaptor.enable(argparse.Namespace(swap_optimizer=True, use_distributed_optimizer=True, bf16=True))
    try:
        model, optimizer = build(1e-30)  # every update skipped
        swapped = mains(optimizer)
        holder = getattr(optimizer.chained_optimizers[0], STATE_HOLDER)
        assert isinstance(holder.mains, SwappedOptimizerState)
        homes = [m.data_ptr() for m in swapped]
        assert not step(model, optimizer, 1), "the update was skipped"
        assert [m.data_ptr() for m in swapped] == homes and not holder.mains.released, "their host copies"
        for main, start in zip(swapped, before, strict=True):
            assert torch.equal(main, start)
        for opt in optimizer.chained_optimizers:
            opt.config.grad_norm_skip_threshold = float("inf")
        assert step(model, optimizer, 1)
        for main, ref in zip(swapped, mains(optimizer_ref), strict=True):
            assert torch.equal(main, ref)
    finally:
        mm_adaptor.disable()
