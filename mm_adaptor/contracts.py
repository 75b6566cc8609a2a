"""Patch contracts: what a patch was verified against, checked before it is applied.

For megatron-core a contract is per upstream function, not per version range: every target has a fingerprint
of its code in each tagged megatron-core release (mm_adaptor/megatron_fingerprints.py, made by
scripts/fingerprint_megatron.py), and each feature records the versions it was verified on. A patch serves when
the installed target's code is that of a verified version, whatever the installed version; otherwise only the
features patching that function refuse, in one line naming it. A megatron-core outside SUPPORTED_MEGATRON_CORE
gets one warning per process, nothing more. Contracts on other packages (torch) keep the plain version check.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import os
import textwrap
import warnings
from dataclasses import dataclass

import wrapt
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from mm_adaptor import fingerprints
from mm_adaptor.errors import ConfigurationError

ALLOW_MISMATCH_ENV = "MM_ADAPTOR_ALLOW_CONTRACT_MISMATCH"
# The megatron-core releases the project installs beside (pyproject.toml's dependency says the same; a test checks).
# Outside it: one warning, then each feature by its fingerprints.
SUPPORTED_MEGATRON_CORE = ">=0.16.0,<0.20"
MEGATRON_CORE = "megatron-core"
# The megatron-core versions each feature (or compatibility/device patch set, by name) was verified on: its
# regression checks passed there. A name not listed has the default.
DEFAULT_VERIFIED = ("0.16.1",)
VERIFIED_ON: dict[str, tuple[str, ...]] = {
    # 0.17.1 and 0.18.0 (pip 0.18.2 has core_v0.18.0's code in every patched function; pip 0.17.1 differs from
    # core_v0.17.0 in _copy_main_params_to_model_params, a backported NVFP4 branch): where a feature's functions
    # differ from 0.16.1's and 0.19.0's there, check passed on the pip release with the mechanism counted: coc bit for
    # bit in tp2-sp (fp32 N=2, bf16 N=4) and tp2 N=8, ep2-moe x expert TP2 within tolerance; fused-rotary-pos-emb
    # within tolerance fp32/bf16; swap-attention bit for bit fp32/bf16 (0.18: also HybridModel "*-*-");
    # recompute-activation-function bit for bit, GPT and HybridModel "*-*-"; reuse-fp32-param bit for bit in tp2 and
    # dp2-distopt --overlap-param-gather bf16; swap-optimizer dp2-distopt fp32/bf16 and virtual-optimizer tp2 fp32,
    # dp2-distopt bf16 bit for bit; the broken variants of coc, reuse, swap-attention and recompute fail. Megatron-LM
    # pretrain_gpt.py from core_v0.18.2 trains on the CPU and the fake NPU (initialize_megatron still asserts CUDA
    # unless allow_no_cuda, the one thing the wrapper passes).
    # 0.19.0: WrappedTorchNorm.__new__ gained a return annotation only; the SP/persist tests and the tp2-sp layouts
    # pass on 0.19.2 (benchmarks/megatron_0_19_trial.md).
    "compat:torch-norm": ("0.16.1", "0.19.0"),
    # 0.19.0: load_state_dict matches param groups by identifier with None for missing keys and builds state per
    # optimizer_state_keys; the step fix after it is unchanged; dp2-distopt checkpoint resume passes on 0.19.2.
    "compat:torch-adam-distributed-checkpoint": ("0.16.1", "0.19.0"),
    # Features: `mm-adaptor check` passed on 0.19.2 in every layout where the feature acts (bit for bit where it is
    # exact), with the installed functions equal to core_v0.19.0's (benchmarks/megatron_0_19_trial.md).
    "vpp-extra-warmup": ("0.16.1", "0.19.0"),
    "recompute-activation-function": ("0.16.1", "0.18.0", "0.19.0"),
    "fused-swiglu": ("0.16.1", "0.19.0"),
    "fused-rotary-pos-emb": ("0.16.1", "0.17.1", "0.18.0", "0.19.0"),
    "swap-attention": ("0.16.1", "0.17.1", "0.18.0", "0.19.0"),
    # 0.19.0: WrappedTorchNorm.__new__ gained a return annotation only; check --layout all passes on 0.19.2.
    "fused-rmsnorm": ("0.16.1", "0.19.0"),
    # 0.19.0 has no GroupedMLP: --moe-grouped-gemm's local-spec SequentialMLP runs its experts as one grouped_matmul
    # per fc; check passes on 0.19.2 in ep2-moe (fp32, bf16) and tp2-sp, a wrong-wgrad variant fails
    # (tests/latest/test_fused_gmm_on_latest.py).
    "fused-gmm": ("0.16.1", "0.19.0"),
    # 0.19.0: the optimizer functions these wrap gained Lion (init_state_fn, optimizer_state_keys), quantized and
    # NVFP4 params, Megatron-FSDP branches and GTP metadata copies, none on the bf16/fp32 Adam paths the wrappers
    # keep; get_megatron_optimizer returns a ChainedOptimizer whose step may skip step_with_ready_grads after
    # prepare_grads (grad_norm_skip_threshold), so swap-optimizer's main parameters go back to host memory at the
    # end of prepare_grads. On 0.19.2 check passes bit for bit with the mechanism's bytes (reuse: tp2, dp2-distopt
    # --overlap-param-gather; swap: dp2-distopt fp32/bf16; virtual: tp2 fp32, dp2-distopt bf16), checkpoints load
    # both ways, the broken variants fail (tests/latest/test_optimizer_features_on_latest.py).
    "reuse-fp32-param": ("0.16.1", "0.17.1", "0.18.0", "0.19.0"),
    "swap-optimizer": ("0.16.1", "0.17.1", "0.19.0"),
    "virtual-optimizer": ("0.16.1", "0.17.1", "0.19.0"),
    # 0.19.0: initialize_megatron no longer parses arguments but still asserts CUDA unless allow_no_cuda (the one
    # thing the wrapper passes); megatron.legacy.fused_kernels is gone, so its skip applies only where it exists.
    # Megatron-LM's pretrain_gpt.py from core_v0.19.0 trains on the CPU (benchmarks/megatron_0_19_trial.md).
    "device:cpu:megatron-training": ("0.16.1", "0.18.0", "0.19.0"),
    # 0.19.0: the linear function lost async_grad_allreduce (0.17; tp_group took its position) and gained
    # gtp_remat_size, as did both linears' forwards (0.19: a GTP-sharded weight, left to megatron; arguments bound by
    # the installed signature); routed_experts_compute gained the delayed-wgrad hook (0.18) and the zero-copy expert
    # buffers (0.19), both left to megatron, as are --moe-grouped-gemm experts (0.17+ builds SequentialMLP for them,
    # --use-fused-gmm's); the all-to-all dispatcher's TP gather/sort and SequentialMLP are unchanged. On 0.19.2:
    # check bit for bit in tp2-sp (fp32 N=2/4, bf16 N=4), tp2 (N=8 uneven), pp2 x TP2+SP, TP2+SP x DP2 distopt+GAF;
    # ep2-moe x expert TP2 within tolerance with the expert chunks counted; the broken variant fails
    # (tests/latest/test_coc_on_latest.py).
    "coc": ("0.16.1", "0.17.1", "0.18.0", "0.19.0"),
    # 0.19.0: the same initialize_megatron wrapper; _compile_dependencies is no longer replaced (it builds only the
    # dataset index helpers there, and the legacy kernel skip covers core_v0.16). pretrain_gpt.py from core_v0.19.0
    # trains on the FAKE npu (benchmarks/RESULTS.md); only Ascend hardware can show more.
    "device:npu:megatron-training": ("0.16.1", "0.18.0", "0.19.0"),
}
# Targets whose contract is their parameters alone: Megatron-LM entry points the adaptor only wraps to call through
# (adding its flags, enabling features after validation, passing allow_no_cuda); their bodies change every release
# without concerning the wrapper.
SIGNATURE_ONLY = frozenset({
    "megatron.training.arguments.add_megatron_arguments",
    "megatron.training.arguments.validate_args",
    "megatron.training.yaml_arguments.validate_yaml",
    "megatron.training.initialize.initialize_megatron",
})


class PatchError(RuntimeError):
    pass


class PatchContractError(PatchError, ConfigurationError):
    pass


class PatchContractWarning(UserWarning):
    pass


class MegatronVersionWarning(UserWarning):
    """The installed megatron-core is outside SUPPORTED_MEGATRON_CORE (said once per process)."""


def _mismatch_allowed() -> bool:
    return os.environ.get(ALLOW_MISMATCH_ENV, "").strip().lower() in ("1", "true", "yes")


def _underlying(obj):
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    elif isinstance(obj, property) and obj.fget is not None:
        obj = obj.fget
    try:
        return inspect.unwrap(obj)
    except ValueError:
        return obj


def fingerprint(obj) -> str:
    """16 hex digits identifying the source text of obj (or its signature when no source exists): the pin of a
    contract's explicit `fingerprint` (`mm-adaptor fingerprint` prints it)."""
    target = _underlying(obj)
    if isinstance(target, wrapt.ObjectProxy):
        target = target.__wrapped__
    try:
        source = textwrap.dedent(inspect.getsource(target))
        text = "\n".join(line.rstrip() for line in source.splitlines())
    except (OSError, TypeError):
        try:
            text = "sig:" + str(inspect.signature(target))
        except (TypeError, ValueError):
            text = "repr:" + repr(target)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def installed_version(package: str = MEGATRON_CORE) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# Test variants that patch a feature's own upstream functions (deliberately broken copies for the self-tests):
# name -> the feature whose verified versions they share (verified_like).
STANDS_IN_FOR: dict[str, str] = {}


def verified_like(stand_in: str, feature: str) -> None:
    STANDS_IN_FOR[stand_in] = feature


def verified_versions(feature: str) -> tuple[str, ...]:
    return VERIFIED_ON.get(STANDS_IN_FOR.get(feature, feature), DEFAULT_VERIFIED)


def recorded_fingerprints(target: str) -> dict[str, str | None] | None:
    """version -> fingerprint of the target in that megatron-core release, None when the table lacks it."""
    from mm_adaptor.megatron_fingerprints import FINGERPRINTS

    return FINGERPRINTS.get(target)


_live: dict[str, str | None] = {}


def live_fingerprint(target: str) -> str | None:
    """The installed target's fingerprint (from its source file, normalised as the table is); None if undefined."""
    if target not in _live:
        _live[target] = fingerprints.installed_fingerprint(target, signature_only=target in SIGNATURE_ONLY)
    return _live[target]


def _same_version(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def megatron_problem(feature: str, target: str, installed: str) -> str | None:
    """Why `feature` may not patch `target` on the installed megatron-core, in a few words naming it; None if it
    may: the target's code equals its code in a version the feature was verified on."""
    verified = verified_versions(feature)
    on = " or ".join(verified)
    recorded = recorded_fingerprints(target)
    if recorded is None or not any(v in recorded for v in verified):
        if any(_same_version(installed, v) for v in verified):
            return None
        return (f"no fingerprint of {target} is recorded for megatron-core {on} to compare with {installed}'s "
                "(run scripts/fingerprint_megatron.py)")
    live = live_fingerprint(target)
    if any(v in recorded and recorded[v] == live for v in verified):
        return None
    if live is None:
        return f"{target} is not defined in megatron-core {installed} (verified on {on})"
    return f"{target} changed in megatron-core {installed} (its code differs from {on}, where it was verified)"


_warned_range: set[str] = set()


def warn_if_outside_range(installed: str | None = None) -> bool:
    """One MegatronVersionWarning per process when megatron-core is installed outside SUPPORTED_MEGATRON_CORE."""
    installed = installed if installed is not None else installed_version()
    if installed is None or SpecifierSet(SUPPORTED_MEGATRON_CORE).contains(installed, prereleases=True):
        return False
    if installed not in _warned_range:
        _warned_range.add(installed)
        warnings.warn(
            f"megatron-core {installed} is outside the versions mm_adaptor installs beside "
            f"({SUPPORTED_MEGATRON_CORE}); each feature serves where the upstream functions it patches are "
            "unchanged from a version it was verified on and refuses naming the function otherwise "
            "(`mm-adaptor report` lists them)", MegatronVersionWarning, stacklevel=2)
    return True


@dataclass(frozen=True)
class Contract:
    """What a patch of `package` was verified against. For megatron-core: the per-version fingerprints of the
    target (looked up by target) and the feature's verified versions; `versions` is the range the project
    installs beside. For other packages: `versions` must contain the installed one. `fingerprint`, if given,
    pins the original's source text (or value) exactly, on every version."""

    versions: str
    fingerprint: str | None = None
    package: str = MEGATRON_CORE

    def problems(self, original, *, feature: str, target: str) -> tuple[list[str], str | None]:
        installed = installed_version(self.package)
        problems = []
        if installed is None:
            problems.append(f"{self.package} is not installed")
        elif self.package == MEGATRON_CORE:
            warn_if_outside_range(installed)
            problem = megatron_problem(feature, target, installed)
            if problem:
                problems.append(problem)
        elif not SpecifierSet(self.versions).contains(installed, prereleases=True):
            problems.append(f"{self.package} {installed} is installed, outside the supported versions")
        if self.fingerprint is not None:
            actual = fingerprint(original)
            if actual != self.fingerprint:
                where = f"{target}: " if self.package == MEGATRON_CORE else ""
                problems.append(f"{where}the original's source changed (fingerprint {actual}, expected "
                                f"{self.fingerprint})")
        return problems, installed

    def check(self, original, *, feature: str, target: str) -> None:
        problems, installed = self.problems(original, feature=feature, target=target)
        if not problems:
            return
        if self.package == MEGATRON_CORE and installed is not None:  # each problem names the function and versions
            message = f"feature {feature or '?'!r} refuses: {'; '.join(problems)}"
        else:
            found = f"{self.package} {installed}" if installed else f"{self.package} (not installed)"
            message = (f"feature {feature or '?'!r} cannot patch {target}: {'; '.join(problems)}; installed: {found}; "
                       f"this patch supports {self.package} {self.versions}")
        if _mismatch_allowed():
            warnings.warn(f"{message}; applied anyway ({ALLOW_MISMATCH_ENV} is set)", PatchContractWarning,
                          stacklevel=4)
            return
        raise PatchContractError(f"{message}; set {ALLOW_MISMATCH_ENV}=1 to downgrade this to a warning")


warn_if_outside_range()
