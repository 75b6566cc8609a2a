"""Megatron-LM's optimizer timers (optimizer-inner-step, optimizer-copy-main-to-model-params) still run when the
optimizer-state features take over the inner step: one megatron optimizer step in one gloo rank, with a timers
object that records what was started and stopped."""

import pytest
import torch

import mm_adaptor
from mm_adaptor.core.features import get


class RecordingTimers:
    """Megatron's Timers call shape: timers(name, log_level=...) gives an object with start(barrier=) and stop()."""

    def __init__(self):
        self.log = []

    def __call__(self, name, log_level=None):
        log = self.log

        class Timer:
            def start(self, barrier=False):
                log.append(("start", name))

            def stop(self, barrier=False):
                log.append(("stop", name))

        return Timer()


TIMED = ("optimizer-inner-step", "optimizer-copy-main-to-model-params")


@pytest.fixture
def rank():
    from gloo_rank import one_gloo_rank

    with one_gloo_rank():
        yield


@pytest.mark.parametrize("flags", [
    ["--reuse-fp32-param"],
    ["--swap-optimizer", "--use-distributed-optimizer"],
    ["--reuse-fp32-param", "--virtual-optimizer"],
], ids=" ".join)
def test_optimizer_timers_start_and_stop_with_the_feature_on(flags, rank):
    from megatron.core import tensor_parallel

    from mm_adaptor.patches.optimizer.state_holder import holder_of
    from mm_adaptor.harness.runner.arguments import build_parser, finalize_args
    from mm_adaptor.harness.runner.model import build_model, build_optimizer, transformer_config, wrap_model

    args = build_parser().parse_args(["--num-layers", "2", "--nproc-per-node", "1", "--bf16", *flags])
    finalize_args(args, 1)
    mm_adaptor.enable(args)
    try:
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        config = transformer_config(args)
        model = wrap_model(args, config, build_model(args, config, torch.device("cpu")))
        optimizer, _ = build_optimizer(args, config, model)
        timers = RecordingTimers()
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner.config.timers = timers
        assert any(holder_of(o) is not None for o in getattr(optimizer, "chained_optimizers", [optimizer])), \
            "the feature's holder runs the inner step"
        tokens = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
        model[0](tokens, torch.arange(32).expand(2, 32), None, labels=tokens).float().sum().backward()
        for chunk in model:
            chunk.finish_grad_sync()
        ok, _, _ = optimizer.step()
        assert ok
        assert get(flags[0].lstrip("-")).statistics()["steps"] == 1, "the feature ran the inner step"
        for name in TIMED:
            assert ("start", name) in timers.log and ("stop", name) in timers.log, (name, timers.log)
            assert timers.log.index(("start", name)) < timers.log.index(("stop", name))
    finally:
        mm_adaptor.disable()
