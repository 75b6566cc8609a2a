"""Where each feature has run, per device: what this project has seen run and checked, not what it expects.

States: "verified" (ran there and passed check against unpatched Megatron), "stand-in" (its code path ran only on a
stand-in for the device, e.g. the CPU backend's no-op streams), "not run". `mm-adaptor report` prints these, and
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
FAKE_NPU_RAN = ("the NPU backend trained the tiny GPT on a FAKE npu device in CI (tests/fake_npu: PyTorch's "
                "PrivateUse1 on host memory, the CPU fallback for ops, its own generator, an 'hccl' over gloo; "
                "tests/npu): TP2+SP and PP2 print the CPU backend's loss lines, DP2 with the distributed optimizer and "
                "EP2 MoE within 1e-6; every parameter, gradient and optimizer state on npu, no torch.cuda lazy call "
                "queued, dropout masks agree across TP ranks and under full recompute")
NPU_HARDWARE_ONLY = ("only Ascend hardware can show: kernel numerics, HCCL itself (its timeouts, topology, "
                     "fp64 refusals as the real library words them), stream concurrency, swapped memory, speed; "
                     "no NPU run recorded")
CUDA_COMPILED = "CUDA kernels compile-checked with nvcc; " + NO_GPU
STREAMS_ON_CPU = "side streams, events and pinned memory ran only as the CPU backend's no-ops; " + NO_GPU


def _same_everywhere(cuda: str, npu: str = NO_NPU, cpu: str = CPU_CHECKED) -> dict[str, Record]:
    return {"cpu": Record("verified", cpu), "cuda": Record("not run", cuda), "npu": Record("not run", npu)}


FEATURES: dict[str, dict[str, Record]] = {
    "coc": _same_everywhere("NCCL overlap " + NO_GPU + " (needs two GPUs)"),
    "flash-attn": _same_everywhere(NO_GPU),
    "fused-gmm": _same_everywhere(CUDA_COMPILED),
    "fused-rmsnorm": _same_everywhere(CUDA_COMPILED),
    "fused-rotary-pos-emb": _same_everywhere(CUDA_COMPILED),
    "fused-swiglu": _same_everywhere(CUDA_COMPILED),
    "optimize-vocab-parallel-ce": _same_everywhere(NO_GPU),
    "recompute-activation-function": _same_everywhere(NO_GPU),
    "reuse-fp32-param": _same_everywhere(CUDA_COMPILED),
    "swap-attention": _same_everywhere(STREAMS_ON_CPU),
    "swap-optimizer": _same_everywhere(STREAMS_ON_CPU),
    "virtual-optimizer": _same_everywhere("mapped host memory (host_mapped_copy) " + CUDA_COMPILED),
    "vpp-extra-warmup": _same_everywhere(NO_GPU),
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
