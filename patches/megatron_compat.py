"""Fixes megatron-core 0.16 needs to run at all without Transformer Engine (any device)."""

from __future__ import annotations

import torch

from mm_adaptor.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet



def _te_min_version_false_without_te(wrapped, instance, args, kwargs):
    from megatron.core.utils import get_te_version

    try:
        if get_te_version() is None:
            return False
    except Exception:
        return False
    return wrapped(*args, **kwargs)


def _move_split_sizes_to_host(tensor, as_numpy=False, record_stream=False):
    """megatron's version converts only CUDA tensors; host tensors must honour as_numpy too."""
    if torch.is_tensor(tensor):
        if tensor.device.type != "cpu":
            tensor = tensor.to(torch.device("cpu"), non_blocking=True)
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


def _softmax_kernel_unavailable_without_extension(wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    except ImportError:
        return False


def _sequence_parallel_torch_norm(wrapped, instance, args, kwargs):
    """Build the torch norm under sequence parallelism and mark its weights sequence-parallel.

    A norm is per token, so it runs unchanged on sequence shards; its weight gradients are partial
    sums per TP rank, and megatron all-reduces the grads of parameters marked `sequence_parallel`
    across the TP group (exactly what it does for Transformer Engine's norms).
    """
    config = args[1] if len(args) > 1 else kwargs["config"]
    if not config.sequence_parallel:
        return wrapped(*args, **kwargs)
    config.sequence_parallel = False
    try:
        norm = wrapped(*args, **kwargs)
    finally:
        config.sequence_parallel = True
    for param in norm.parameters():
        param.sequence_parallel = True
    return norm


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
    """With torch's own Adam, the per-parameter `step` ends up 0 after megatron's dp_reshardable load
    (the checkpoint's step lives in the param groups); Adam's bias correction needs the real step."""
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


def _without_autograd(wrapped, instance, args, kwargs):
    with torch.no_grad():
        return wrapped(*args, **kwargs)


def sequence_parallel_norm_patches() -> PatchSet:
    """The local spec's torch norm (used without Apex/TE) refuses sequence parallelism; this lifts that."""
    ps = PatchSet("compat:sequence-parallel-torch-norm")
    ps.wrap("megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__", _sequence_parallel_torch_norm,
            contract=Contract(versions=SUPPORTED_MEGATRON_CORE))
    return ps


def gradient_accumulation_fusion_patches() -> PatchSet:
    """Megatron's gradient-accumulation fusion without Apex: `fused_weight_gradient_mlp_cuda` is provided by the
    native matmul_add_fp32 (mm_adaptor.ops.wgrad). Megatron's flag keeps its meaning: off runs the plain path."""
    ps = PatchSet("compat:gradient-accumulation-fusion")
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401  (Apex's own extension wins when installed)

        return ps
    except ImportError:
        pass
    import importlib

    wgrad = importlib.import_module("mm_adaptor.ops.wgrad")
    core = Contract(versions=SUPPORTED_MEGATRON_CORE)
    ps.provide_module("fused_weight_gradient_mlp_cuda", wgrad)
    ps.replace("megatron.core.tensor_parallel.layers._grad_accum_fusion_available", True, contract=core)
    ps.replace("megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda", wgrad, contract=core,
               create=True)
    return ps


def no_transformer_engine_patches() -> PatchSet:
    """Applied by every backend when Transformer Engine is not installed."""
    ps = PatchSet("compat:no-transformer-engine")
    try:
        import transformer_engine  # noqa: F401

        return ps
    except Exception:
        pass
    core = Contract(versions=SUPPORTED_MEGATRON_CORE)
    ps.wrap("megatron.core.utils.is_te_min_version", _te_min_version_false_without_te, contract=core)
    ps.replace("megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu",
               _move_split_sizes_to_host, contract=core)
    ps.wrap("megatron.core.fusions.fused_softmax.FusedScaleMaskSoftmax.is_kernel_available",
            _softmax_kernel_unavailable_without_extension, contract=core)
    ps.wrap("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.state_dict",
            _dist_optimizer_state_dict_before_first_step, contract=core)
    # In fp32 the main params are views of the model params; megatron copies into them with autograd on.
    ps.wrap("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_parameter_state_from_dp_reshardable",
            _without_autograd, contract=core)
    ps.wrap("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict",
            _restore_adam_step_after_load, contract=core)
    # RouterGatingLinearFunction reads this name, which megatron defines only when TE imports.
    ps.replace("megatron.core.transformer.moe.moe_utils.te_general_gemm", None, contract=core, create=True)
    return ps
