"""Runs the harness's runner (train.run, 2 ranks) once per spec on the device each names and prints one RESULT= JSON
line: losses, grad norms, whether TP ranks' layer outputs agree, and the fake npu probe's rank files.
A script for a fresh interpreter (tests/npu/fake.py puts the FAKE torch_npu on its path)."""

import json
import os
import sys
import tempfile


def one(spec: dict) -> dict:
    import torch

    from mm_adaptor.harness import runner as train

    os.environ["MM_ADAPTOR_DEVICE"] = spec["device"]
    probe = tempfile.mkdtemp(prefix="fake-npu-probe-")
    os.environ["MM_ADAPTOR_FAKE_NPU_PROBE"] = probe
    if spec.get("break"):
        os.environ["MM_ADAPTOR_FAKE_NPU_BREAK"] = spec["break"]
    else:
        os.environ.pop("MM_ADAPTOR_FAKE_NPU_BREAK", None)
    argv = [*spec["args"], "--nproc-per-node", "2", "--train-iters", str(spec.get("iters", 3)), "--timeout", "300"]
    try:
        ranks = train.run(train.parse_args(argv)).ranks
    except Exception as exc:  # the broken variants must fail somewhere: say where
        return {"error": f"{type(exc).__name__}: {str(exc)[-2000:]}"}
    layers = sorted(k for k in ranks[0].activations if k.endswith(".output") and k in ranks[1].activations)
    same = {k: torch.equal(ranks[0].activations[k], ranks[1].activations[k]) for k in layers}
    probes = {}
    for name in sorted(os.listdir(probe)):
        with open(os.path.join(probe, name)) as f:
            probes[name] = json.load(f)
    return {"losses": [r.losses for r in ranks], "grad_norms": [r.grad_norms for r in ranks],
            "layer_outputs_equal_across_ranks": same, "probe": probes}


if __name__ == "__main__":
    specs = json.loads(sys.argv[1])
    print("RESULT=" + json.dumps([one(spec) for spec in specs]), flush=True)
