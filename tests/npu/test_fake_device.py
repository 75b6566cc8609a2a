"""The FAKE npu device (tests/fake_npu): real storage on `npu`, the CPU fallback, its own generator, the fake
'hccl' backend over gloo. One subprocess per check group; the test session itself never imports torch_npu."""

import pytest

from tests.npu.fake import run_python

pytestmark = pytest.mark.npu

DEVICE = r"""
import json, torch, torch_npu
x = torch.arange(12.0, device="npu").view(3, 4)
y = (x.t().contiguous() * 2 + 1).view(-1)
grad_in = torch.randn(5, 6, device="npu", requires_grad=True)
torch.nn.functional.dropout(grad_in, 0.5, training=True).sum().backward()
state = torch.npu.get_rng_state()
torch.npu.manual_seed(7); first = torch.rand(4, device="npu").cpu()
torch.manual_seed(7); host = torch.rand(4)
torch.npu.manual_seed(7); cpu_state = torch.get_rng_state(); again = torch.rand(4, device="npu").cpu()
g = torch.Generator(device="npu"); g.manual_seed(11)
own = [torch.rand(3, generator=g, device="npu").cpu() for _ in range(2)]; g.manual_seed(11)
own_repeats = g.device.type == "npu" and torch.equal(own[0], torch.rand(3, generator=g, device="npu").cpu())
print("RESULT=" + json.dumps({
    "fake": [torch_npu.FAKE, "FAKE" in torch_npu.__version__, "FAKE" in torch_npu.report(),
             "FAKE" in torch_npu.__doc__],
    "devices": [str(x.device), str(y.device), str(grad_in.grad.device), torch.npu.device_count()],
    "values": y.cpu().tolist(), "sum": x.sum().item(),
    "allocated": torch.npu.memory_allocated(), "peak": torch.npu.max_memory_allocated(),
    "draws": torch_npu._random.DRAWS, "npu_draw_repeats": first.tolist() == again.tolist(),
    "cpu_generator_untouched": torch.equal(cpu_state, torch.get_rng_state()),
    "npu_generator_object": own_repeats and not torch.equal(own[0], own[1]),
    "methods": [torch.ones(2).npu().is_npu, torch.nn.Linear(2, 2).npu().weight.device.type],
}))
"""


def test_storage_views_copies_fallback_and_generator():
    r = run_python(DEVICE)
    assert r["fake"] == [True, True, True, True]
    assert r["devices"] == ["npu:0", "npu:0", "npu:0", 2]
    assert r["values"] == [2 * v + 1 for v in (0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11)]
    assert r["sum"] == 66.0
    assert r["allocated"] > 0 and r["peak"] >= r["allocated"]
    # dropout and rand went through the fake generator's kernels, not the CPU fallback's
    assert r["draws"].get("native_dropout") and r["draws"].get("uniform_") and r["draws"].get("normal_")
    assert r["npu_draw_repeats"] and r["cpu_generator_untouched"]
    assert r["npu_generator_object"]  # torch.Generator(device='npu') exists (as torch_npu's does) and advances
    assert r["methods"] == [True, "npu"]


HCCL = r"""
import json, os, sys, torch, torch.multiprocessing as mp

def rank_main(rank, port, out):
    import torch_npu, torch.distributed as dist
    torch.npu.set_device(rank)
    dist.init_process_group("hccl", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    x = torch.full((4,), float(rank + 1), device="npu")
    dist.all_reduce(x)
    gathered = torch.empty(8, device="npu"); dist.all_gather_into_tensor(gathered, x)
    part = torch.empty(2, device="npu"); dist.reduce_scatter_tensor(part, torch.arange(4.0, device="npu"))
    got = torch.empty(3, device="npu")
    if rank == 0: dist.send(torch.arange(3.0, device="npu"), 1)
    else: dist.recv(got, 0)
    # uneven lists, as megatron's gather/reduce-scatter with split sizes (MoE token dispatch) send them
    sizes = [3, 1]
    uneven = [torch.empty(s, 2, device="npu") for s in sizes]
    dist.all_gather(uneven, torch.full((sizes[rank], 2), float(rank + 1), device="npu"))
    scattered = torch.empty(sizes[rank], 2, device="npu")
    dist.reduce_scatter(scattered, list(torch.arange(8.0, device="npu").view(4, 2).mul(rank + 1).split(sizes)))
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.float64, device="npu")); fp64 = "accepted"
    except RuntimeError as e:
        fp64 = str(e)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"device": str(x.device), "x": x.cpu().tolist(), "gathered": gathered.cpu().tolist(),
                   "part": part.cpu().tolist(), "got": got.cpu().tolist(), "fp64": fp64,
                   "uneven": [t.cpu().tolist() for t in uneven], "scattered": scattered.cpu().tolist(),
                   "calls": torch_npu.hccl.CALLS, "backend": dist.get_backend()}, f)
    dist.destroy_process_group()

if __name__ == "__main__":
    import socket, tempfile
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    out = tempfile.mktemp()
    mp.spawn(rank_main, args=(port, out), nprocs=2)
    print("RESULT=" + json.dumps([json.load(open(f"{out}.{r}")) for r in range(2)]))
"""


def test_hccl_backend_runs_gloo_on_npu_tensors_and_refuses_fp64(tmp_path):
    script = tmp_path / "hccl_ranks.py"
    script.write_text(HCCL)
    r = run_python(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    for rank, result in enumerate(r):
        assert result["device"] == f"npu:{rank}" and result["backend"] == "hccl"
        assert result["x"] == [3.0] * 4 and result["gathered"] == [3.0] * 8
        assert result["part"] == ([0.0, 2.0] if rank == 0 else [4.0, 6.0])
        assert "float64" in result["fp64"]
        assert result["uneven"] == [[[1.0, 1.0]] * 3, [[2.0, 2.0]]] and result["calls"]["allgather_uneven"] == 1
        assert result["scattered"] == ([[0.0, 3.0], [6.0, 9.0], [12.0, 15.0]] if rank == 0 else [[18.0, 21.0]])
        assert result["calls"]["allreduce"] >= 1 and result["calls"]["all_gather_single"] == 1
    assert r[1]["got"] == [0.0, 1.0, 2.0]


CPU_KERNELS = r"""
import json, torch, torch_npu
torch.manual_seed(0)
x = (torch.randn(64, 2, 64) * 3 + 1).requires_grad_()
w, b = torch.randn(64).requires_grad_(), torch.randn(64).requires_grad_()
dy = torch.randn(64, 2, 64)
def run(dev):
    xs, ws, bs = (t.detach().to(dev).requires_grad_() for t in (x, w, b))
    y = torch.nn.functional.layer_norm(xs, (64,), ws, bs, 1e-5)
    y.backward(dy.to(dev))
    return [t.detach().cpu() for t in (y, xs.grad, ws.grad, bs.grad)]
same = [torch.equal(a, c) for a, c in zip(run("cpu"), run("npu"))]
print("RESULT=" + json.dumps({"routed": torch_npu.CPU_ROUTED_OPS, "layer_norm_fwd_bwd_equal": same}))
"""


def test_ops_with_a_cpu_kernel_run_it_not_their_decomposition():
    """native_layer_norm has a CPU kernel and a CompositeExplicitAutograd one; on a PrivateUse1 device the latter
    wins over the fallback, and its rounding differs: DP2 and EP2 training drifted from the CPU backend in the 7th
    digit. The fake routes every such op to its CPU kernel; the broken fake (routing skipped) must differ."""
    routed = run_python(CPU_KERNELS, devices=1)
    assert routed["routed"] > 100 and routed["layer_norm_fwd_bwd_equal"] == [True] * 4
    broken = run_python(CPU_KERNELS, devices=1, MM_ADAPTOR_FAKE_NPU_BREAK="composite")
    assert broken["routed"] == 0 and not broken["layer_norm_fwd_bwd_equal"][0]
