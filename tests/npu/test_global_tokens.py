"""The driver's global token count is all-reduced as an integer: exact beyond 2**53, and no float64 collective,
which HCCL does not have (the NPU backend would otherwise route it through its float64 workaround)."""

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.npu


def test_global_tokens_all_reduces_an_int64_count(monkeypatch):
    from megatron.core import parallel_state as ps

    from mm_adaptor.harness.runner import loop

    seen = []

    def all_reduce(tensor, *args, **kwargs):  # two ranks that read the same tokens
        seen.append(tensor.dtype)
        tensor.mul_(2)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 1)
    count = 2**53 + 1  # float64 would round it
    assert loop._global_tokens(SimpleNamespace(tokens_this_step=count), 0, "cpu") == 2 * count
    assert seen == [torch.int64]
    assert loop._global_tokens(SimpleNamespace(), 123, "cpu") == 123
