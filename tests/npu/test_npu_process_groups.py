"""The NPU backend's process-group mapping on the FAKE npu: megatron's --nccl-communicator-config-path builds
torch.distributed.ProcessGroupNCCL.Options, which the CPU build of torch under torch_npu lacks; is_nccl_available
answers for HCCL to callers outside torch while torch's own c10d keeps its answer."""

import pytest

from tests.npu.fake import run_python

pytestmark = pytest.mark.npu

GROUPS = r"""
import json, os, socket, sys, tempfile, warnings, torch, torch.multiprocessing as mp

def rank_main(rank, port, out, config):
    import torch_npu, torch.distributed as dist
    sys.path.insert(0, os.getcwd())
    from mm_adaptor import devices
    from megatron.core import parallel_state as ps
    torch_own_answer = dist.is_nccl_available()
    devices.install("npu")
    torch.npu.set_device(rank)
    result = {"torch_own_answer": torch_own_answer, "is_nccl_available": dist.is_nccl_available(),
              "c10d_is_nccl_available": dist.distributed_c10d.is_nccl_available()}
    dist.init_process_group("nccl", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ps.initialize_model_parallel(tensor_model_parallel_size=2, nccl_communicator_config_path=config)
            x = torch.full((2,), float(rank + 1), device="npu")
            dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
            result.update(sum=x.cpu().tolist(), backend=dist.get_backend(ps.get_tensor_model_parallel_group()))
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
    result["warnings"] = [str(w.message) for w in caught if "NCCL communicator options" in str(w.message)]
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    out = tempfile.mktemp()
    config = out + ".yaml"
    with open(config, "w") as f:
        f.write("tp:\n  max_ctas: 4\n  cga_cluster_size: 2\ndp:\n  is_high_priority_stream: true\n")
    mp.spawn(rank_main, args=(port, out, config), nprocs=2)
    print("RESULT=" + json.dumps([json.load(open(f"{out}.{r}")) for r in range(2)]))
"""


def test_nccl_communicator_configs_and_is_nccl_available_on_the_npu_backend(tmp_path):
    script = tmp_path / "groups.py"
    script.write_text(GROUPS)
    for result in run_python(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"):
        assert "error" not in result, result["error"]
        assert result["sum"] == [3.0, 3.0] and result["backend"] == "hccl"
        # torch_npu installs beside a CPU build of torch (no NCCL: False); 3.12's registry torch is a CUDA build
        assert result["is_nccl_available"] is True and result["c10d_is_nccl_available"] is result["torch_own_answer"]
        if not result["torch_own_answer"]:
            assert len(result["warnings"]) == 1, result["warnings"]  # once, naming what is dropped


RESTORE = r"""
import json, sys, torch, torch_npu, torch.distributed as dist
sys.path.insert(0, __import__("os").getcwd())
from mm_adaptor import devices
before = (dist.is_nccl_available, hasattr(dist, "ProcessGroupNCCL"))
devices.install("npu")
during = (dist.is_nccl_available(), hasattr(dist, "ProcessGroupNCCL"),
          dist.distributed_c10d.is_nccl_available is before[0])
devices.uninstall()
after = (dist.is_nccl_available is before[0], hasattr(dist, "ProcessGroupNCCL"))
print("RESULT=" + json.dumps({"before": before[1], "during": during, "after": after}))
"""


def test_uninstalling_the_npu_backend_restores_torch_distributed():
    r = run_python(RESTORE, devices=1)
    built_with_nccl = r["before"]  # False under torch_npu's CPU build of torch; True for a CUDA build
    assert r == {"before": built_with_nccl, "during": [True, True, True], "after": [True, built_with_nccl]}
