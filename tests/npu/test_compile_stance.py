"""On the NPU backend, megatron's torch.compile'd fusions (jit_fuser) run eagerly in every thread: torch's config
value torch._dynamo.config.disable is per context, so a thread that did not set it (the autograd engine's device
thread, where e.g. megatron's swiglu backward runs) compiled anyway and failed on a device inductor does not know.
The old patch (config.disable) must fail this check; the stance patch passes it."""

import pytest

from tests.npu.fake import run_python

pytestmark = pytest.mark.npu

COMPILED_IN_ANOTHER_THREAD = r"""
import json, os, threading, torch
import mm_adaptor.megatron_adaptor  # noqa: F401  (the NPU backend's device patches)
from torch._dynamo import eval_frame
if os.environ.get("OLD_PATCH"):
    eval_frame._stance = eval_frame.DynamoStance()
    torch._dynamo.config.disable = True
    seen = []  # per context (a ContextVar in newer torch), or one module attribute (torch 2.6, 2.7)?
    probe = threading.Thread(target=lambda: seen.append(torch._dynamo.config.disable))
    probe.start(); probe.join()
    PER_CONTEXT = not seen[0]

@torch.compile
def doubled(x):
    return x * 2

result = {"stance": eval_frame._stance.stance}
if os.environ.get("OLD_PATCH"):
    result["config_per_context"] = PER_CONTEXT
def in_another_thread():
    try:
        result["value"] = doubled(torch.ones(3, device="npu")).cpu().tolist()
    except Exception as error:
        result["error"] = type(error).__name__
thread = threading.Thread(target=in_another_thread)
thread.start()
thread.join()
print("RESULT=" + json.dumps(result))
"""


def test_compiled_functions_run_eagerly_in_a_thread_the_patch_never_entered():
    r = run_python(COMPILED_IN_ANOTHER_THREAD, devices=1)
    assert r == {"stance": "force_eager", "value": [2.0, 2.0, 2.0]}


def test_the_per_context_config_switch_is_not_enough():
    r = run_python(COMPILED_IN_ANOTHER_THREAD, devices=1, OLD_PATCH="1")
    if r.pop("config_per_context"):
        assert r.get("error"), r  # inductor was asked to compile for 'npu'
    else:  # torch 2.6, 2.7: config.disable is one module attribute, which every thread sees; the old patch was enough
        assert r == {"stance": "default", "value": [2.0, 2.0, 2.0]}
