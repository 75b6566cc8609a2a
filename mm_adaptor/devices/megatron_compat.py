"""Fixes megatron-core 0.16 needs without Transformer Engine / Apex, on every device.

Each set fixes a configuration that unpatched megatron refuses or crashes on (its `unpatched` text says how);
none changes what a configuration that runs unpatched computes. Device-specific fixes live in the device
backends (mm_adaptor/devices/). `mm-adaptor report` prints each set; `mm_adaptor.applied()` lists their
targets under `backend:<name>`.
"""

from __future__ import annotations

import functools

import torch

from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet, fingerprint

WITHOUT_TE = "every device, when Transformer Engine is not installed"


@functools.lru_cache(maxsize=None)
def _transformer_engine_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def _transformer_engine_serves(ps: PatchSet, because: str = "Transformer Engine is installed") -> bool:
    """The one Transformer Engine guard of the patch sets needed only without it: where TE imports, `ps` is not
    needed (and says why)."""
    if _transformer_engine_importable():
        ps.not_needed = because
        return True
    return False


def _core() -> Contract:
    return Contract(versions=SUPPORTED_MEGATRON_CORE)


def _megatron_core_at_least(version: str) -> bool:
    from packaging.version import Version

    from mm_adaptor.versions.contracts import installed_version

    installed = installed_version()
    return installed is not None and Version(installed) >= Version(version)


def _te_min_version_false_without_te(wrapped, instance, args, kwargs):
    from megatron.core.utils import get_te_version

    try:
        if get_te_version() is None:
            return False
    except Exception:
        return False
    return wrapped(*args, **kwargs)


def _softmax_kernel_unavailable_without_extension(wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    except ImportError:
        return False


def _torch_norm_lifting_apex_only_switches(wrapped, instance, args, kwargs):
    """Build the torch norm with persist_layer_norm and under sequence parallelism.

    persist_layer_norm only selects Apex's persistent LayerNorm kernel (same math), so the torch norm
    ignores it. A norm is per token, so it runs unchanged on sequence shards; its weight gradients are
    partial sums per TP rank, and megatron all-reduces the grads of parameters marked
    `sequence_parallel` across the TP group (exactly what it does for Transformer Engine's norms).
    """
    config = args[1] if len(args) > 1 else kwargs["config"]
    sequence_parallel, persist = config.sequence_parallel, config.persist_layer_norm
    if not sequence_parallel and not persist:
        return wrapped(*args, **kwargs)
    config.sequence_parallel, config.persist_layer_norm = False, False
    try:
        norm = wrapped(*args, **kwargs)
    finally:
        config.sequence_parallel, config.persist_layer_norm = sequence_parallel, persist
    if sequence_parallel:
        for param in norm.parameters():
            param.sequence_parallel = True
    return norm


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                               interleaved: bool = False) -> torch.Tensor:
    """megatron's TE-backed fused RoPE for [s, b, h, d] (same signature), on the native mm_adaptor::rotary_pos_emb.
    transpose_output_memory is a memory-layout hint that TE ignores too."""
    from mm_adaptor import ops

    return ops.rotary_pos_emb(t, freqs, interleaved)


def _dist_optimizer_state_dict_before_first_step(wrapped, instance, args, kwargs):
    """With torch's own Adam (no Apex/TE), megatron reads `step` from the per-parameter state, which is
    empty until the first step, so building a checkpoint-loading template for a fresh optimizer
    asserts. Before the first step the step is 0."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE or instance.optimizer.state:
        return wrapped(*args, **kwargs)
    inner = instance.optimizer.state_dict()
    state_dict = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
    for group in state_dict["optimizer"]["param_groups"]:
        del group["params"]
        group["step"] = 0
    if instance.grad_scaler:
        state_dict["grad_scaler"] = instance.grad_scaler.state_dict()
    return state_dict


def _restore_adam_step_after_load(wrapped, instance, args, kwargs):
    """With torch's own Adam, megatron's dp_reshardable load copies the loading template's per-parameter
    `step` (0 for a fresh optimizer) over the checkpoint's; the checkpoint's step is in the param groups,
    and Adam's bias correction needs it."""
    from megatron.core.optimizer import distrib_optimizer

    result = wrapped(*args, **kwargs)
    if not distrib_optimizer.HAVE_APEX_OR_TE:
        for group in instance.optimizer.param_groups:
            if group.get("step") is None:
                continue
            for param in group["params"]:
                state = instance.optimizer.state.get(param)
                if state is not None and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)
    return result


def _torch_adam_step_not_in_shards(wrapped, instance, args, kwargs):
    """With torch's Adam each parameter's optimizer state holds `step`, which the fully reshardable load leaves out
    of the shards it hands over (the step comes from the param groups, _restore_adam_step_after_load); megatron
    then looks it up among them."""
    from megatron.core.optimizer import distrib_optimizer

    model_param, tensors = (list(args) + [None, None])[:2]
    tensors = kwargs.get("tensors", tensors)
    if not distrib_optimizer.HAVE_APEX_OR_TE and isinstance(tensors, dict) and "step" not in tensors:
        return wrapped(kwargs.get("model_param", model_param), {**tensors, "step": None})
    return wrapped(*args, **kwargs)


def _without_autograd(wrapped, instance, args, kwargs):
    with torch.no_grad():
        return wrapped(*args, **kwargs)


def te_version_query_patches() -> PatchSet:
    ps = PatchSet(
        "compat:te-version-query", needed_on=WITHOUT_TE,
        changes="is_te_min_version answers False when Transformer Engine is not installed, so megatron's own "
                "'needs Transformer Engine >= x' checks speak (or its pre-TE branch runs)",
        unpatched="raises TypeError ('>=' not supported between instances of 'NoneType' and 'Version'); megatron asks "
                  "only on TE-only paths (fp8/fp4, precision-aware optimizer, TE op fuser, CUDA graphs, --qk-clip, "
                  "--rotary-interleaved with rope fusion, ...): dense and MoE local-spec runs never reach it")
    if _transformer_engine_serves(ps):
        return ps
    ps.wrap("megatron.core.utils.is_te_min_version", _te_min_version_false_without_te, contract=_core())
    return ps


def moe_router_without_te_patches() -> PatchSet:
    ps = PatchSet(
        "compat:moe-router-without-te", needed_on=WITHOUT_TE,
        changes="defines moe_utils.te_general_gemm = None, so the MoE router's gating GEMM takes megatron's torch path",
        unpatched="every MoE router forward raises NameError: name 'te_general_gemm' is not defined "
                  "(moe_utils.RouterGatingLinearFunction reads a name megatron defines only when TE imports)")
    if _transformer_engine_serves(ps):
        return ps
    if _megatron_core_at_least("0.17.0"):
        # Its fingerprint differs from 0.16.1's because megatron now assigns the name itself: the fix is upstream.
        ps.not_needed = ("megatron-core >= 0.17 defines moe_utils.te_general_gemm itself (None without Transformer "
                         "Engine), so the router already takes its torch path")
        return ps
    ps.replace("megatron.core.transformer.moe.moe_utils.te_general_gemm", None, contract=_core(), create=True)
    return ps


def fused_softmax_availability_patches() -> PatchSet:
    ps = PatchSet(
        "compat:fused-softmax-availability", needed_on=WITHOUT_TE,
        changes="FusedScaleMaskSoftmax.is_kernel_available answers False when the CUDA softmax extension "
                "(scaled_masked_softmax_cuda) cannot be imported, so megatron's torch softmax runs",
        unpatched="with --masked-softmax-fusion (Megatron-LM's default) and bf16/fp16 attention scores of a "
                  "kernel-eligible shape, raises ModuleNotFoundError: No module named 'scaled_masked_softmax_cuda'")
    if _transformer_engine_serves(ps):
        return ps
    ps.wrap("megatron.core.fusions.fused_softmax.FusedScaleMaskSoftmax.is_kernel_available",
            _softmax_kernel_unavailable_without_extension, contract=_core())
    return ps


def torch_adam_distributed_checkpoint_patches() -> PatchSet:
    ps = PatchSet(
        "compat:torch-adam-distributed-checkpoint", needed_on=WITHOUT_TE + " (the wrappers act only without Apex too)",
        changes="DistributedOptimizer with torch's Adam: state_dict() before the first step reports step 0; "
                "load_parameter_state_from_dp_reshardable runs under no_grad; after load_state_dict each "
                "parameter's Adam step is the checkpoint's (param-group) step; a fully reshardable load hands each "
                "parameter's shards over without a step (megatron expects one per optimizer state tensor)",
        unpatched="--load of a --use-distributed-optimizer checkpoint into a fresh optimizer raises AssertionError "
                  "(distrib_optimizer.py: assert len(steps) == 1, no step yet); in fp32 the dp_reshardable load then "
                  "raises RuntimeError (in-place copy into a view of a leaf that requires grad); and a dp_reshardable "
                  "load leaves Adam's step at the loading template's value instead of the checkpoint's; and "
                  "--dist-ckpt-optim-fully-reshardable's load raises KeyError: 'step'")
    if _transformer_engine_serves(ps, "Transformer Engine is installed (its FusedAdam keeps step in the param groups)"):
        return ps
    base = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
    ps.wrap(f"{base}.state_dict", _dist_optimizer_state_dict_before_first_step, contract=_core())
    # In fp32 the main params are views of the model params; megatron copies into them with autograd on.
    ps.wrap(f"{base}.load_parameter_state_from_dp_reshardable", _without_autograd, contract=_core())
    ps.wrap(f"{base}.load_state_dict", _restore_adam_step_after_load, contract=_core())
    ps.wrap(f"{base}._set_main_param_and_optimizer_states", _torch_adam_step_not_in_shards, contract=_core())
    return ps


def torch_norm_patches() -> PatchSet:
    """The local spec's torch norm (used without Apex, and always for RMSNorm) refuses sequence parallelism and
    persist_layer_norm; this lifts both."""
    ps = PatchSet(
        "compat:torch-norm", needed_on="every device (the local spec uses the torch norm without Apex, and for "
                                       "RMSNorm always)",
        changes="WrappedTorchNorm builds under --sequence-parallel (its weights marked sequence_parallel, so megatron "
                "all-reduces their grads across the TP group as it does for TE's norms) and with persist_layer_norm "
                "(which only selects Apex's persistent LayerNorm kernel, same math)",
        unpatched="raises AssertionError: persist_layer_norm not supported by torch LayerNorm (Megatron-LM's default; "
                  "--no-persist-layer-norm avoids it), or: sequence parallel not supported by torch LayerNorm")
    ps.wrap("megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__", _torch_norm_lifting_apex_only_switches,
            contract=_core())
    return ps


def rope_fusion_patches() -> PatchSet:
    ps = PatchSet(
        "compat:rope-fusion", needed_on=WITHOUT_TE,
        changes="defines rope_utils.fused_apply_rotary_pos_emb (None without TE) on the native "
                "mm_adaptor::rotary_pos_emb, so Megatron-LM's default rope fusion runs for [s, b, h, d] (packed "
                "sequences still need --no-rope-fusion, as without TE unpatched)",
        unpatched="TransformerConfig raises ValueError: apply_rope_fusion is not available. Please install TE >= 1.4. "
                  "(--no-rope-fusion avoids it)")
    if _transformer_engine_serves(ps, "Transformer Engine is installed (megatron uses TE's fused RoPE)"):
        return ps
    # The contract's fingerprint is None's: an existing kernel is never replaced.
    ps.replace("megatron.core.models.common.embeddings.rope_utils.fused_apply_rotary_pos_emb",
               fused_apply_rotary_pos_emb, contract=Contract(versions=SUPPORTED_MEGATRON_CORE,
                                                             fingerprint=fingerprint(None)), create=True)
    return ps


def gradient_accumulation_fusion_patches() -> PatchSet:
    """Megatron's gradient-accumulation fusion without Apex: `fused_weight_gradient_mlp_cuda` is provided by the
    native matmul_add_fp32 (mm_adaptor.ops.wgrad). Megatron's flag keeps its meaning: off runs the plain path."""
    ps = PatchSet(
        "compat:gradient-accumulation-fusion", needed_on="every device, when Apex's fused_weight_gradient_mlp_cuda "
                                                         "is not installed",
        changes="provides the module fused_weight_gradient_mlp_cuda on the native mm_adaptor::matmul_add_fp32, so "
                "--gradient-accumulation-fusion (Megatron-LM's default) accumulates weight gradients into main_grad",
        unpatched="ColumnParallelLinear raises RuntimeError: ... gradient_accumulation_fusion set to True but the "
                  "custom CUDA extension fused_weight_gradient_mlp_cuda module is not found "
                  "(--no-gradient-accumulation-fusion avoids it)")
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401  (Apex's own extension wins when installed)

        ps.not_needed = "Apex's fused_weight_gradient_mlp_cuda is installed"
        return ps
    except ImportError:
        pass
    import importlib

    wgrad = importlib.import_module("mm_adaptor.ops.wgrad")
    ps.provide_module("fused_weight_gradient_mlp_cuda", wgrad)
    ps.replace("megatron.core.tensor_parallel.layers._grad_accum_fusion_available", True, contract=_core())
    ps.replace("megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda", wgrad, contract=_core(),
               create=True)
    return ps


def _skip_make_when_built(wrapped, instance, args, kwargs):
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return wrapped(*args, **kwargs)
    return None


def prebuilt_dataset_helpers_patches() -> PatchSet:
    ps = PatchSet(
        "compat:dataset-helpers-prebuilt", needed_on="every device, with megatron.training",
        changes="megatron.core.datasets.utils.compile_helpers does nothing when the compiled helpers (helpers_cpp) "
                "already import; otherwise it runs make as before",
        unpatched="megatron.training's initialization runs make in megatron/core/datasets, and the megatron-core "
                  "wheel ships helpers_cpp built but no Makefile: make fails and rank 0 exits (sys.exit(1), "
                  "'Failed to compile the C++ dataset helper functions')")
    ps.wrap("megatron.core.datasets.utils.compile_helpers", _skip_make_when_built, contract=_core())
    return ps


def every_device_patch_sets() -> list[PatchSet]:
    return [te_version_query_patches(), moe_router_without_te_patches(), fused_softmax_availability_patches(),
            torch_adam_distributed_checkpoint_patches(), torch_norm_patches(), rope_fusion_patches(),
            gradient_accumulation_fusion_patches(), prebuilt_dataset_helpers_patches()]
