"""Where each feature has run, per device: what this project has seen run and checked, not what it expects.

States: "verified" (ran there and passed check against unpatched Megatron), "stand-in" (its code path ran only on a
stand-in for the device, e.g. the CPU backend's no-op streams, or the fake npu: never "verified" for an NPU without
Ascend hardware), "not run". `mm-adaptor report` prints these, and
the README's feature table says the same. Change a state only with the run that justifies it (a RESULTS.md entry)."""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("cpu", "cuda", "npu")
STATES = ("verified", "stand-in", "not run")


@dataclass(frozen=True)
class Record:
    state: str
    evidence: str

    def __post_init__(self):
        if self.state not in STATES:
            raise ValueError(f"unknown verification state {self.state!r}; one of {', '.join(STATES)}")


CPU_CHECKED = "check against unpatched Megatron on the CPU backend over gloo in CI (tests/distributed)"
NO_GPU = "no GPU run recorded"
NO_NPU = "no NPU run recorded (torch_npu path written against its documented API)"
FAKE_NPU = ("a FAKE npu device in CI (tests/fake_npu: PyTorch's PrivateUse1 on host memory, each op's CPU kernel, its "
            "own generator, an 'hccl' over gloo refusing fp64, torch_npu's ops as reference math with its schemas)")
FAKE_NPU_RAN = (f"the NPU backend trained the tiny GPT on {FAKE_NPU} (tests/npu): TP2+SP, PP2, DP2 with the "
                "distributed optimizer and EP2 MoE give the CPU backend's losses and grad norms bit for bit; every "
                "parameter, gradient and optimizer state on npu, no torch.cuda lazy call queued, dropout masks agree "
                "across TP ranks and under full recompute")
NPU_HARDWARE_ONLY = ("only Ascend hardware can show: kernel numerics, HCCL itself (its timeouts, topology, "
                     "fp64 refusals as the real library words them), stream concurrency, swapped memory, speed; "
                     "no NPU run recorded")
NPU_CHECK = "tests/npu/test_npu_check.py"


def _fake_npu_check(layout: str, kernels: str = "") -> Record:
    """The feature's code path on the NPU backend passed `mm-adaptor check` on the fake npu, nothing more."""
    ran = f"; torch_npu's {kernels} ran (the fake's reference math)" if kernels else ""
    return Record("stand-in", f"mm-adaptor check passed on {FAKE_NPU}, {layout} ({NPU_CHECK}){ran}; "
                              f"{NPU_HARDWARE_ONLY}")


TP2_DISTOPT = "TP2+SP with the distributed optimizer"
EP2_BF16 = "EP2 MoE in bf16"
PP2_VPP = "PP2 with VPP2"
CUDA_COMPILED = "CUDA kernels compile-checked with nvcc; " + NO_GPU
STREAMS_ON_CPU = "side streams, events and pinned memory ran only as the CPU backend's no-ops; " + NO_GPU


def _same_everywhere(cuda: str, npu: Record | None = None, cpu: str = CPU_CHECKED) -> dict[str, Record]:
    return {"cpu": Record("verified", cpu), "cuda": Record("not run", cuda), "npu": npu or Record("not run", NO_NPU)}


FEATURES: dict[str, dict[str, Record]] = {
    "coc": _same_everywhere("NCCL overlap " + NO_GPU + " (needs two GPUs)", _fake_npu_check(TP2_DISTOPT)),
    "flash-attn": _same_everywhere(NO_GPU, _fake_npu_check(
        TP2_DISTOPT, "npu_fusion_attention and npu_fusion_attention_grad")),
    "fused-gmm": _same_everywhere(CUDA_COMPILED, _fake_npu_check(EP2_BF16, "npu_grouped_matmul")),
    "fused-rmsnorm": _same_everywhere(CUDA_COMPILED, _fake_npu_check(TP2_DISTOPT,
                                                                     "npu_rms_norm and npu_rms_norm_backward")),
    "fused-rotary-pos-emb": _same_everywhere(CUDA_COMPILED, _fake_npu_check(
        TP2_DISTOPT, "npu_rotary_mul and npu_rotary_mul_backward (rotary_mode 'interleave' in tests/npu only)")),
    "fused-swiglu": _same_everywhere(CUDA_COMPILED, _fake_npu_check(TP2_DISTOPT,
                                                                    "npu_swiglu and npu_swiglu_backward")),
    "optimize-vocab-parallel-ce": _same_everywhere(NO_GPU, _fake_npu_check(TP2_DISTOPT)),
    "recompute-activation-function": _same_everywhere(NO_GPU, _fake_npu_check(TP2_DISTOPT)),
    "reuse-fp32-param": _same_everywhere(CUDA_COMPILED, _fake_npu_check(EP2_BF16)),
    "swap-attention": _same_everywhere(STREAMS_ON_CPU, _fake_npu_check(
        TP2_DISTOPT + " (the fake's streams are synchronous)")),
    "swap-optimizer": _same_everywhere(STREAMS_ON_CPU, _fake_npu_check(
        TP2_DISTOPT + " (the fake's streams are synchronous)")),
    "virtual-optimizer": _same_everywhere(
        "mapped host memory (host_mapped_copy) " + CUDA_COMPILED,
        Record("not run", "refused on NPU (host_mapped_copy): torch_npu's swapped-memory tensors take only fill_, "
                          "zero_, npu_apply_adam_w and the hans codecs by its documentation, not the element-wise "
                          "Adam the virtual optimizer runs on them (docs/npu.md); " + NO_NPU)),
    "vpp-extra-warmup": _same_everywhere(NO_GPU, _fake_npu_check(PP2_VPP)),
}

BACKENDS: dict[str, Record] = {
    "cpu": Record("verified", "trains every layout and feature in CI"),
    "cuda": Record("not run", "megatron's own CUDA path, nothing adapted; " + NO_GPU + " for the adaptor"),
    "npu": Record("stand-in", f"{FAKE_NPU_RAN}; {NPU_HARDWARE_ONLY}"),
}

UNRECORDED = Record("not run", "no run recorded for this feature (not one of mm_adaptor's own)")


def record(feature: str, device: str) -> Record:
    return FEATURES.get(feature, {}).get(device, UNRECORDED)


def backend_verified(device: str) -> bool:
    return BACKENDS.get(device, UNRECORDED).state == "verified"


def summary(feature: str) -> str:
    """One line: each device's state, e.g. 'cpu verified, cuda not run, npu not run'."""
    return ", ".join(f"{device} {record(feature, device).state}" for device in DEVICES)
