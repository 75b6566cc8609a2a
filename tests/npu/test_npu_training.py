"""`mm-adaptor train` on the FAKE npu device prints the CPU backend's losses digit for digit, keeps every tensor on
`npu`, leaves no torch.cuda lazy call queued, and draws dropout masks from the npu generator the way megatron's
RNG tracker means (TP ranks agree on replicated activations; full recompute reproduces the masks). The broken
variants (RNG redirect removed; device='cuda' left unmapped) must fail these checks."""

import json
from pathlib import Path

import pytest
import torch

from tests.npu.fake import run_python

pytestmark = pytest.mark.npu

TP2_SP = ["--num-layers", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
TP2_DROPOUT = ["--num-layers", "2", "--tensor-model-parallel-size", "2", "--hidden-dropout", "0.1",
               "--attention-dropout", "0.1"]
DISTOPT = ["--num-layers", "2", "--use-distributed-optimizer"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
LAYOUTS = {
    "pp2": ["--num-layers", "2", "--pipeline-model-parallel-size", "2"],
    "dp2_distopt": ["--num-layers", "2", "--use-distributed-optimizer", "--overlap-grad-reduce"],
    "ep2_moe": ["--num-layers", "2", "--num-experts", "4", "--expert-model-parallel-size", "2"],
    # one local expert per rank: npu_grouped_matmul's group list of length 1
    "ep2_fused_gmm_one_local_expert": ["--num-layers", "2", "--num-experts", "2", "--expert-model-parallel-size", "2",
                                       "--moe-grouped-gemm", "--disable-bias-linear", "--use-fused-gmm"],
}
SPECS = {
    "cpu": {"device": "cpu", "args": TP2_SP},
    "npu": {"device": "npu", "args": TP2_SP},
    **{f"cpu_{name}": {"device": "cpu", "args": args} for name, args in LAYOUTS.items()},
    **{f"npu_{name}": {"device": "npu", "args": args} for name, args in LAYOUTS.items()},
    # Dropout is checked on the npu against itself: the CPU backend's masks share torch's CPU generator with the
    # host-side initialisation, a device's (CUDA's or the NPU's) do not.
    "npu_dropout": {"device": "npu", "args": TP2_DROPOUT},
    "npu_dropout_recompute": {"device": "npu", "args": [*TP2_DROPOUT, *RECOMPUTE]},
    # npu_fusion_attention's own dropout (the kernel draws its seed from the npu generator, inside the RNG tracker)
    "npu_dropout_flash": {"device": "npu", "args": [*TP2_DROPOUT, "--use-flash-attn"]},
    "npu_dropout_flash_recompute": {"device": "npu", "args": [*TP2_DROPOUT, "--use-flash-attn", *RECOMPUTE]},
    # the side streams' copies are deferred on the fake until waited for: a forgotten wait shows in the losses
    "npu_distopt": {"device": "npu", "args": DISTOPT},
    "npu_swap_optimizer": {"device": "npu", "args": [*DISTOPT, "--swap-optimizer"]},
    "npu_swap_optimizer_broken_wait": {"device": "npu", "args": [*DISTOPT, "--swap-optimizer"], "break": "swap-wait"},
    "npu_broken_rng": {"device": "npu", "args": TP2_DROPOUT, "break": "rng"},
    "npu_broken_device": {"device": "npu", "args": TP2_SP, "break": "device", "iters": 1},
}


# On torch 2.6 (the NPU leg) this layout's grad norms differ from the CPU backend's in the 8th digit (3e-8 relative)
# while every loss is the same float; on torch 2.13 they are equal. Not isolated yet (the expert GEMMs alone agree
# bit for bit on the fake there); the printed loss lines agree either way.
GRAD_NORMS_ROUND_APART_ON_OLD_TORCH = {"ep2_fused_gmm_one_local_expert"}


@pytest.fixture(scope="module")
def runs():
    script = Path(__file__).with_name("train_runs.py")
    root = str(Path(__file__).parents[2])
    source = (f"import runpy, sys; sys.argv = [{str(script)!r}, {json.dumps(json.dumps(list(SPECS.values())))}]; "
              f"sys.path.insert(0, {root!r}); runpy.run_path(sys.argv[0], run_name='__main__')")
    results = run_python(source, timeout=900)
    return dict(zip(SPECS, results))


@pytest.mark.parametrize("layout", ["tp2_sp", *LAYOUTS])
def test_layout_gives_the_cpu_backends_losses_and_grad_norms_bit_for_bit(runs, layout):
    """Every step's loss and grad norm as the same float (so the printed loss lines agree digit for digit). The fake
    runs each op's CPU kernel, as the CPU backend does; torch's Adam takes its foreach path on npu and its per-tensor
    path on the CPU, and the two agree bit for bit."""
    cpu, npu = (runs["cpu"], runs["npu"]) if layout == "tp2_sp" else (runs[f"cpu_{layout}"], runs[f"npu_{layout}"])
    assert "error" not in npu, npu.get("error")
    assert "error" not in cpu, cpu.get("error")
    assert npu["losses"] == cpu["losses"], (npu, cpu)
    if layout in GRAD_NORMS_ROUND_APART_ON_OLD_TORCH and torch.__version__ < "2.7":
        pairs = [(a, b) for n, c in zip(npu["grad_norms"], cpu["grad_norms"]) for a, b in zip(n, c)]
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in pairs), (npu, cpu)
    else:
        assert npu["grad_norms"] == cpu["grad_norms"], (npu, cpu)
    assert _printed(npu) == _printed(cpu)
    assert npu["losses"][0][-1] < npu["losses"][0][0]


def _printed(run):
    return ([[f"{x:E}" for x in r] for r in run["losses"]], [[f"{x:.3f}" for x in r] for r in run["grad_norms"]])


def test_every_tensor_lives_on_npu_and_no_cuda_lazy_call_is_queued(runs):
    for name in ("npu", "npu_dropout", *(f"npu_{layout}" for layout in LAYOUTS)):
        probes = runs[name]["probe"]
        assert sorted(probes) == ["rank0.json", "rank1.json"]
        for probe in probes.values():
            assert probe["model_param_count"] > 0 and probe["optimizer_state_count"] > 0
            for kind in ("optimizer_params", "model_params", "grads", "optimizer_states"):
                assert probe[kind] == ["npu"], (name, kind, probe[kind])
            assert probe["buffers"] in ([], ["npu"])
            assert probe["queued_cuda_lazy_calls"] == [], probe["queued_cuda_lazy_calls"]
            assert probe["hccl_calls"].get("allreduce", 0) > 0  # TP all-reduces ran on the fake HCCL
            # nothing float64 went to HCCL by way of the interception, which torch < 2.7 does not consult
            assert probe["fp64_all_reduces"] == 0, (name, probe["fp64_all_reduces"])
    assert all(p["draws"].get("native_dropout", 0) > 0 for p in runs["npu_dropout"]["probe"].values())


def test_tp_ranks_agree_on_replicated_activations_under_dropout(runs):
    same = runs["npu_dropout"]["layer_outputs_equal_across_ranks"]
    assert same and all(same.values()), same


def test_full_recompute_reproduces_the_dropout_masks(runs):
    # the losses bit for bit; the gradient norms to float32 rounding (recompute sums in another order), where
    # one different mask would move them by about 1e-2
    assert runs["npu_dropout_recompute"]["losses"] == runs["npu_dropout"]["losses"]
    recomputed, plain = runs["npu_dropout_recompute"]["grad_norms"][0], runs["npu_dropout"]["grad_norms"][0]
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(recomputed, plain)), (recomputed, plain)


def test_flash_attention_dropout_on_npu_is_reproduced_by_recompute(runs):
    plain, recomputed = runs["npu_dropout_flash"], runs["npu_dropout_flash_recompute"]
    assert "error" not in plain and "error" not in recomputed, (plain.get("error"), recomputed.get("error"))
    assert recomputed["losses"] == plain["losses"]
    same = plain["layer_outputs_equal_across_ranks"]
    assert same and all(same.values()), same
    for probe in plain["probe"].values():  # the kernel ran with dropout: its seeds came from the npu generator
        assert probe["npu_ops"].get("npu_fusion_attention", 0) > 0 and probe["draws"].get("random_.from", 0) > 0
    assert plain["losses"] != runs["npu_dropout"]["losses"]  # not megatron's attention dropout


def test_swap_optimizer_waits_for_its_side_streams(runs):
    plain, swapped, broken = runs["npu_distopt"], runs["npu_swap_optimizer"], runs["npu_swap_optimizer_broken_wait"]
    for run in (plain, swapped):
        assert "error" not in run, run.get("error")
    assert swapped["losses"] == plain["losses"]
    assert all(p["deferred_copies"] > 0 for p in swapped["probe"].values())  # the copies did wait for a wait
    # without the wait the next step reads the host copies before they arrive: NaN, which megatron stops on
    assert "found NaN" in broken.get("error", "") or broken["losses"] != plain["losses"], broken


def test_broken_rng_redirect_is_caught(runs):
    broken, good = runs["npu_broken_rng"], runs["npu_dropout"]
    assert "error" not in broken, broken.get("error")
    assert any(p["queued_cuda_lazy_calls"] for p in broken["probe"].values())
    assert broken["losses"] != good["losses"]


def test_unmapped_cuda_device_argument_is_caught(runs):
    error = runs["npu_broken_device"].get("error", "")
    assert "CUDA" in error or "NVIDIA" in error, runs["npu_broken_device"]  # a CPU or a CUDA build of torch
