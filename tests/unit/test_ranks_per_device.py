"""One rank per device where the collective library needs it: refused before any rank starts, and `check`
falls back to its single-rank layout on a node with one GPU. The CUDA backend's device count is simulated."""


import pytest
import torch

from mm_adaptor import devices

from mm_adaptor.cli import check
from mm_adaptor.devices.cpu import CpuBackend
from mm_adaptor.devices.cuda import CudaBackend
from mm_adaptor.harness.compare import LAYOUTS, checked_args, ranks_for
from mm_adaptor.harness.runner import LayoutError, check_args, parse_args


@pytest.fixture
def one_gpu_node(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(devices, "current", lambda: None)
    monkeypatch.setattr(devices, "choose", lambda: ("cuda", "simulated"))


def test_backend_counts_devices_per_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda = CudaBackend()
    assert cuda.ranks_per_node_problem(2) is None
    problem = cuda.ranks_per_node_problem(4)
    assert "4 ranks on this node need 4 CUDA devices" in problem and "torch sees 2" in problem
    assert "--nproc-per-node 2" in problem
    assert CpuBackend().ranks_per_node_problem(64) is None  # ranks share the host


def test_two_ranks_on_one_gpu_are_refused_before_launch(one_gpu_node):
    args = parse_args(["--num-layers", "2", "--nproc-per-node", "2"])
    with pytest.raises(LayoutError, match="need 2 CUDA devices .* torch sees 1.*--layout single"):
        check_args(args, 2)
    check_args(parse_args(["--num-layers", "2", "--nproc-per-node", "1"]), 1)


def test_check_defaults_to_the_single_rank_layout_on_one_gpu(one_gpu_node, capsys):
    assert check._default_check_layout() == "single"
    assert "layout single (this node has 1 CUDA device" in capsys.readouterr().out
    assert ranks_for("single") == 1
    assert checked_args([*LAYOUTS["single"], "--nproc-per-node", "1"]).nproc_per_node == 1


def test_check_keeps_tp2_sp_where_ranks_share_the_host(monkeypatch):
    monkeypatch.setattr(devices, "current", lambda: None)
    monkeypatch.setattr(devices, "choose", lambda: ("cpu", "simulated"))
    assert check._default_check_layout() == "tp2-sp"
    assert ranks_for("tp2-sp") == 2
