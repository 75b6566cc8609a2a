"""`mm-adaptor check` on the FAKE npu device for every feature that applies there: four grouped runs (features that
validate together share one, as in mm_adaptor.harness.composition), each judged against unpatched Megatron on the
same fake device, with the fake's counters showing that the NPU kernels ran (torch_npu's fused ops, HCCL). The
fake's numerics are the CPU's, so this checks the NPU code paths and the backend under every feature, not Ascend
kernels."""

import json
from pathlib import Path

import pytest

from mm_adaptor.core import features
from tests.npu.fake import run_python

pytestmark = pytest.mark.npu

MODEL = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope"]
RUNS = {
    "tp2_sp_distopt": (["--use-coc", "--swap-optimizer", "--use-flash-attn", "--use-fused-rmsnorm",
                        "--use-fused-rotary-pos-emb", "--use-fused-swiglu", "--optimize-vocab-parallel-ce",
                        "--recompute-activation-function", "--swap-attention", "--swap-min-bytes", "0"],
                       ["--num-layers", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--use-distributed-optimizer", *MODEL]),
    "ep2_moe_bf16": (["--use-fused-gmm", "--reuse-fp32-param", "--moe-zero-memory", "level0"],
                     ["--num-layers", "2", "--num-experts", "4", "--expert-model-parallel-size", "2", *MODEL,
                      "--moe-grouped-gemm", "--disable-bias-linear", "--bf16"]),
    # the chunked all-to-alls on HCCL, the permutation on a side stream of the NPU
    "ep2_moe_overlap": (["--moe-alltoall-overlap-comm", "--moe-permutation-async-comm"],
                        ["--num-layers", "2", "--num-experts", "4", "--expert-model-parallel-size", "2", *MODEL,
                         "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"]),
    # TP2's ranks lent to EP2, the hot expert's weights broadcast and its gradients reduced over HCCL
    "tp2_extend_balanced": (["--moe-tp-extend-ep", "--balanced-moe-experts", "--balanced-moe-hot-expert-num", "1"],
                            ["--num-layers", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                             "--num-experts", "4", *MODEL, "--disable-bias-linear"]),
    "cp2_ring": (["--context-parallel-size", "2", "--context-parallel-algo", "megatron_cp_algo"],
                 ["--num-layers", "2", "--tensor-model-parallel-size", "1", "--nproc-per-node", "2", *MODEL]),
    "pp2_vpp": (["--vpp-extra-warmup"],
                ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                 "1", "--global-batch-size", "8", *MODEL]),
}
# torch_npu kernels each run must have called (the fake counts them per rank process)
KERNELS = {
    "tp2_sp_distopt": ("npu_rms_norm", "npu_rms_norm_backward", "npu_swiglu", "npu_swiglu_backward",
                       "npu_rotary_mul:half", "npu_rotary_mul_backward:half", "npu_fusion_attention",
                       "npu_fusion_attention_grad"),
    "ep2_moe_bf16": ("npu_grouped_matmul",),
    "pp2_vpp": (),
    "ep2_moe_overlap": (),  # HCCL's all-to-alls and the side stream, no torch_npu kernel
    "tp2_extend_balanced": (),  # HCCL's broadcasts and reduces
    "cp2_ring": (),  # HCCL's point-to-point sends (the ring), no torch_npu kernel
}
NOT_ON_THE_FAKE = {
    "virtual-optimizer": "its NPU path refuses (ops/host_mapped.py): torch_npu's swapped-memory tensors take only "
                         "fill_, zero_, npu_apply_adam_w and the hans codecs by its documentation, not the "
                         "element-wise Adam the virtual optimizer runs on them (docs/npu.md)",
}


def _flag_to_feature() -> dict:
    return {feature.main_flag.option: feature.name for feature in features.all_features()}


def test_every_feature_is_checked_on_the_fake_npu_or_says_why_not():
    by_flag = _flag_to_feature()
    covered = {by_flag[token] for flags, _ in RUNS.values() for token in flags if token in by_flag}
    assert covered.isdisjoint(NOT_ON_THE_FAKE)
    built_in = {f.name for f in features.built_in_features()}
    assert covered | set(NOT_ON_THE_FAKE) == built_in


@pytest.fixture(scope="module")
def checks():
    """Every run's check in one interpreter (tests/npu/check_runs.py): a check command of its own would import
    torch, megatron and the fake torch_npu again, about 8 s each."""
    script = Path(__file__).with_name("check_runs.py")
    root = str(Path(__file__).parents[2])
    argvs = [["--iters", "3", *feature_args, *base_args] for feature_args, base_args in RUNS.values()]
    source = (f"import runpy, sys; sys.argv = [{str(script)!r}, {json.dumps(json.dumps(argvs))}]; "
              f"sys.path.insert(0, {root!r}); runpy.run_path(sys.argv[0], run_name='__main__')")
    results = run_python(source, timeout=1800, MM_ADAPTOR_DEVICE="npu", MM_ADAPTOR_BASELINE_CACHE="off")
    return dict(zip(RUNS, results))


@pytest.mark.parametrize("name", list(RUNS))
def test_check_passes_on_the_fake_npu_with_the_npu_kernels(checks, name):
    done = checks[name]
    stdout, probes = done["stdout"], done["probes"]
    assert done["status"] == 0 and "verdict: PASS" in stdout, (stdout[-4000:], done["stderr"][-4000:])
    # the probes are the run with the features (check trains it last)
    assert sorted(probes) == ["rank0.json", "rank1.json"]
    for probe in probes.values():
        assert probe["model_params"] == ["npu"] and probe["queued_cuda_lazy_calls"] == []
        for kernel in KERNELS[name]:
            assert probe["npu_ops"].get(kernel, 0) > 0, (kernel, probe["npu_ops"])
    assert any(p["hccl_calls"] for p in probes.values())
    if "tolerance: bit-for-bit" not in stdout:  # inexact: the NPU is not bitwise reproducible run to run
        assert "noise draws: matrix products in halves, matrix products in thirds, an unperturbed repeat (npu is " \
               "not bitwise reproducible)" in stdout, stdout[-4000:]
        assert "device calibration: none for a layout given by parallel-size flags" in stdout, stdout[-4000:]


def test_verification_records_of_the_npu_say_what_this_module_ran():
    """The npu records are 'stand-in' exactly for the features checked here (never 'verified': no Ascend run), and
    each names the runs' layout and test."""
    from mm_adaptor.core import verification
    by_flag = _flag_to_feature()
    layouts = {"tp2_sp_distopt": verification.TP2_DISTOPT, "ep2_moe_bf16": verification.EP2_BF16,
               "pp2_vpp": verification.PP2_VPP, "cp2_ring": verification.CP2_RING,
               "ep2_moe_overlap": verification.EP2_OVERLAP, "tp2_extend_balanced": verification.TP2_EXTENDED}
    for run, (flags, _) in RUNS.items():
        for feature in {by_flag[t] for t in flags if t in by_flag}:
            record = verification.record(feature, "npu")
            assert record.state == "stand-in" and layouts[run] in record.evidence, (feature, record)
            assert verification.NPU_CHECK.endswith(Path(__file__).name) and "FAKE" in record.evidence
    for feature in NOT_ON_THE_FAKE:
        assert verification.record(feature, "npu").state == "not run"
    assert verification.BACKENDS["npu"].state == "stand-in"
