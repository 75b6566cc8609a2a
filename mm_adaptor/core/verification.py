"""Where each feature has run, per device: what this project has seen run and checked, not what it expects.

States: "verified" (ran there and passed check against unpatched Megatron), "stand-in" (its code path ran only on a
stand-in for the device, e.g. the CPU backend's no-op streams, or the fake npu: never "verified" for an NPU without
Ascend hardware), "failed" (ran there and failed check: an open defect), "not run". Each feature declares its records
(`devices` in its feature_flags/ module). `mm-adaptor report` prints these, and
the README's feature table says the same. Change a state only with the run that justifies it (a RESULTS.md entry)."""

from __future__ import annotations

from dataclasses import dataclass

from mm_adaptor.core.features import BASE_RELEASE  # noqa: F401  (the features' declarations take it from here too)

DEVICES = ("cpu", "cuda", "npu")
STATES = ("verified", "stand-in", "failed", "not run")


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


def fake_npu_check(layout: str, kernels: str = "") -> Record:
    """The feature's code path on the NPU backend passed `mm-adaptor check` on the fake npu, nothing more."""
    ran = f"; torch_npu's {kernels} ran (the fake's reference math)" if kernels else ""
    return Record("stand-in", f"mm-adaptor check passed on {FAKE_NPU}, {layout} ({NPU_CHECK}){ran}; "
                              f"{NPU_HARDWARE_ONLY}")


TP2_DISTOPT = "TP2+SP with the distributed optimizer"
EP2_BF16 = "EP2 MoE in bf16"
PP2_VPP = "PP2 with VPP2"
CP2_RING = "CP2, the ring (HCCL point-to-point)"
EP2_OVERLAP = "EP2 MoE, the alltoall dispatcher (HCCL's all-to-alls in chunks, the NPU's side stream)"
TP2_EXTENDED = "TP2+SP lent to EP2 with 4 experts (HCCL's broadcasts and reduces of the hot expert)"
CUDA_COMPILED = "CUDA kernels compile-checked with nvcc; " + NO_GPU
STREAMS_ON_CPU = "side streams, events and pinned memory ran only as the CPU backend's no-ops; " + NO_GPU
H100_SESSION = "one H100, 2026-11-26 (benchmarks/RESULTS.md#first-gpu-session-one-h100)"
H100_SECOND_SESSION = "one H100, 2026-11-27 (benchmarks/RESULTS.md#second-gpu-session-one-h100)"
STACKED_FUSED_FAILED_ON_H100 = Record(
    "failed", f"check --layout single of fused-rmsnorm, fused-swiglu, fused-rotary-pos-emb and flash-attn stacked, "
              f"fp32, failed on {H100_SESSION}: losses within 7e-8, step-1 gradients up to 5.7x the calibrated limit; "
              f"alone on {H100_SECOND_SESSION}, the device time ran out before this flag's check (open)")


def changed_since_h100(what_ran: str, what_changed: str, session: str = H100_SESSION, compiled: bool = True) -> Record:
    """A feature whose device code changed after its GPU run: that run no longer speaks for today's code."""
    compile_check = "; its CUDA kernels compile-checked with nvcc" if compiled else ""
    return Record("not run", f"today's code has not run on a GPU ({what_changed}{compile_check}); before that "
                             f"change, on {session}: {what_ran}")


# Reasons shared by the features' verified_on declarations.
PIP_0_17_1 = ("pip 0.17.1, where the feature's functions differ from 0.16.1's and 0.19.0's: check passed with the "
              "mechanism counted")
PIP_0_18_2 = "pip 0.18.2 (core_v0.18.0's code in every patched function): check passed with the mechanism counted"
ON_0_19_2 = ("check passes on 0.19.2 in every layout the feature acts in, the installed functions equal to "
             "core_v0.19.0's (the suite's newest leg)")


def on_one_h100(what: str, session: str = H100_SESSION) -> Record:
    """`mm-adaptor check` passed on a GPU session's H100 (one GPU: layout single only)."""
    return Record("verified", f"check --layout single passed on {session}: {what}; multi-GPU layouts not run")


def same_everywhere(cuda: str | Record, npu: Record | None = None, cpu: str = CPU_CHECKED) -> dict[str, Record]:
    """A feature's records: checked on the CPU backend in CI, and what ran on CUDA and the NPU."""
    return {"cpu": Record("verified", cpu), "cuda": cuda if isinstance(cuda, Record) else Record("not run", cuda),
            "npu": npu or Record("not run", NO_NPU)}


BACKENDS: dict[str, Record] = {
    "cpu": Record("verified", "trains every layout and feature in CI"),
    "cuda": Record("not run", "megatron's own CUDA path, nothing adapted (what ran on one H100 is per feature)"),
    "npu": Record("stand-in", f"{FAKE_NPU_RAN}; {NPU_HARDWARE_ONLY}"),
}

UNRECORDED = Record("not run", "no run recorded for this feature (not one of mm_adaptor's own)")


def records(feature: str) -> dict[str, Record]:
    """What the feature's declaration records per device; nothing for a name the registry does not know."""
    from mm_adaptor.core import features
    try:
        return dict(features.get(feature).devices)
    except KeyError:
        return {}


def record(feature: str, device: str) -> Record:
    return records(feature).get(device, UNRECORDED)


def backend_verified(device: str) -> bool:
    return BACKENDS.get(device, UNRECORDED).state == "verified"


def summary(feature: str) -> str:
    """One line: each device's state, e.g. 'cpu verified, cuda not run, npu not run'."""
    return ", ".join(f"{device} {record(feature, device).state}" for device in DEVICES)
