"""The MLP activation kept without its output: its inputs are saved, its output goes to linear_fc2, and once fc2
has saved it the output's storage is released (resize to 0); a hook on fc2's output gradient recomputes the
activation into the same storage before fc2's backward reads it. Megatron's own CheckpointWithoutOutput (the
mechanism behind its moe_act recompute) does the discarding and the recomputation.

Which MLPs take part is decided when a TransformerBlock is built (`block_init_marking_layers`): the first N layers
of each block (one block per virtual pipeline stage), less the layers Megatron recomputes whole (--recompute-method
block). A HybridModel's HybridStack (`stack_init_marking_layers`) counts only its layers that hold an MLP ('-', 'E'):
the first N of those, less the layers Megatron recomputes whole."""

from __future__ import annotations

import functools

import torch

# Set on an MLP (dense, or one SequentialMLP expert) whose activation runs without keeping its output: True, or
# WITH_FC1 when fc1's output is not kept either (fc1 and the activation recomputed together, from fc1's input).
RECOMPUTE_ATTR = "_mm_recompute_activation"
WITH_FC1 = "with fc1"


class _Gives(torch.nn.Module):
    """Stand-in for linear_fc1 while megatron's MLP.forward runs only its activation: returns fc1's outputs."""

    def __init__(self, outputs):
        super().__init__()
        self.outputs = outputs

    def forward(self, *_args, **_kwargs):
        return self.outputs


class _HandsBack(torch.nn.Module):
    """Stand-in for linear_fc2: hands the activation's output back (no bias, so megatron adds none)."""

    def forward(self, x, *_args, **_kwargs):
        return x, None


def _activation_only(wrapped, mlp, kwargs, intermediate, bias, per_token_scale):
    """The activation step of megatron's MLP.forward (and of whatever wraps it, e.g. --use-fused-swiglu) on fc1's
    outputs: the same code runs, with fc1 and fc2 stood in for, so the values are megatron's to the bit."""
    modules = mlp._modules
    fc1, fc2 = modules["linear_fc1"], modules["linear_fc2"]
    modules["linear_fc1"], modules["linear_fc2"] = _Gives((intermediate, bias)), _HandsBack()
    try:
        output, _ = wrapped(None, per_token_scale=per_token_scale, **kwargs)
    finally:
        modules["linear_fc1"], modules["linear_fc2"] = fc1, fc2
    return output


def _fc1_and_activation(wrapped, mlp, kwargs, hidden_states, per_token_scale):
    """megatron's MLP.forward up to fc2's input: fc1 is the real one, fc2 stood in for."""
    modules = mlp._modules
    fc2 = modules["linear_fc2"]
    modules["linear_fc2"] = _HandsBack()
    try:
        output, _ = wrapped(hidden_states, per_token_scale=per_token_scale, **kwargs)
    finally:
        modules["linear_fc2"] = fc2
    return output


def mlp_forward_recomputing_activation(wrapped, instance, args, kwargs, checkpoint_class=None):
    """MLP.forward: fc1 -> activation (inputs kept, output released after fc2 saved it) -> fc2 [-> expert bias].
    checkpoint_class: megatron's CheckpointWithoutOutput unless given (the harness's self-test passes a wrong one)."""
    if instance is None:  # called through the class: MLP.forward(mlp, ...); the original then needs it too
        instance, args = args[0], args[1:]
        wrapped = functools.partial(wrapped, instance)
    scope = getattr(instance, RECOMPUTE_ATTR, False)
    if not scope or not torch.is_grad_enabled():
        return wrapped(*args, **kwargs)
    from megatron.core import tensor_parallel

    kwargs = dict(kwargs)
    hidden_states = args[0] if args else kwargs.pop("hidden_states")
    per_token_scale = args[1] if len(args) > 1 else kwargs.pop("per_token_scale", None)
    if scope == WITH_FC1:
        return _recompute_with_fc1(wrapped, instance, kwargs, hidden_states, per_token_scale, checkpoint_class)
    intermediate, bias = instance.linear_fc1(hidden_states)

    # CheckpointWithoutOutput saves its tensor arguments: pass only the ones that exist.
    inputs = [t for t in (intermediate, bias, per_token_scale) if t is not None]
    has_bias, has_scale = bias is not None, per_token_scale is not None

    def activation(*tensors):
        tensors = list(tensors)
        x = tensors.pop(0)
        b = tensors.pop(0) if has_bias else None
        scale = tensors.pop(0) if has_scale else None
        return _activation_only(wrapped, instance, kwargs, x, b, scale)

    # fp8=None: megatron's default (False) reads as fp8 on and reaches Transformer Engine's FP8 state
    checkpoint = (checkpoint_class or tensor_parallel.CheckpointWithoutOutput)(fp8=None)
    activated = checkpoint.checkpoint(activation, *inputs)
    input_storages = {t.untyped_storage().data_ptr() for t in inputs}
    # (an empty activation, an expert given no rows, has the null data pointer of its empty input too: recompute it)
    if activated.numel() and activated.untyped_storage().data_ptr() in input_storages:
        # an activation that hands back (a view of) its input: nothing to release
        checkpoint.outputs, checkpoint.ctx, checkpoint.run_function = None, None, None
        discard = False
    else:
        discard = True
    output, output_bias = instance.linear_fc2(activated)
    if per_token_scale is not None and output_bias is not None:
        # as megatron: an expert adds its bias, scaled by the routing probabilities, in place
        output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)
        output_bias = None
    if discard:
        checkpoint.discard_output_and_register_recompute(output)
    return output, output_bias


def _recompute_with_fc1(wrapped, mlp, kwargs, hidden_states, per_token_scale, checkpoint_class):
    """fc1 -> activation kept as fc1's input only (fc1's output is not kept either) -> fc2: both are recomputed,
    with fc1's weight gradient, when fc2's output gradient arrives."""
    from megatron.core import tensor_parallel

    inputs = [t for t in (hidden_states, per_token_scale) if t is not None]
    has_scale = per_token_scale is not None

    def fc1_and_activation(x, *scale):
        return _fc1_and_activation(wrapped, mlp, kwargs, x, scale[0] if has_scale else None)

    checkpoint = (checkpoint_class or tensor_parallel.CheckpointWithoutOutput)(fp8=None)
    activated = checkpoint.checkpoint(fc1_and_activation, *inputs)
    output, output_bias = mlp.linear_fc2(activated)
    if per_token_scale is not None and output_bias is not None:
        output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)
        output_bias = None
    checkpoint.discard_output_and_register_recompute(output)
    return output, output_bias


def mark(mlp, scope=True) -> None:
    """Mark one MLP module; a wider scope (WITH_FC1) already there stays."""
    if getattr(mlp, RECOMPUTE_ATTR, False) != WITH_FC1:
        setattr(mlp, RECOMPUTE_ATTR, scope)


def mark_mlp(mlp, scope=True) -> int:
    """Mark a layer's MLP (dense, SequentialMLP experts, GroupedMLP); returns how many were marked."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe import experts as moe_experts
    from megatron.core.transformer.moe.experts import SequentialMLP

    grouped_mlp = getattr(moe_experts, "GroupedMLP", None)  # megatron-core 0.17 removed it

    if type(mlp) is MLP:
        mark(mlp, scope)
        return 1
    experts = getattr(mlp, "experts", None)
    if isinstance(experts, SequentialMLP):
        for expert in experts.local_experts:
            mark(expert, scope)
        return len(experts.local_experts)
    if grouped_mlp is not None and isinstance(experts, grouped_mlp):
        # GroupedMLP's own moe_act recompute is this mechanism (megatron's forward, or --use-fused-gmm's)
        experts.activation_recompute = True
        return 1
    return 0


def layers_to_mark(num_layers: int, config, num_layers_option: int | None) -> range:
    """Local layer indices of a block whose activation is recomputed: the first N (all without N), less the first
    recompute_num_layers that --recompute-granularity full --recompute-method block recomputes whole."""
    first = 0
    if (getattr(config, "recompute_granularity", None) == "full"
            and getattr(config, "recompute_method", None) == "block"):
        first = config.recompute_num_layers or 0
    last = num_layers if num_layers_option is None else min(num_layers, num_layers_option)
    return range(first, max(first, last))


def block_init_marking_layers(num_layers_option: int | None):
    """TransformerBlock.__init__ wrapper that marks the MLPs of the chosen layers."""

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        layers = list(getattr(instance, "layers", []))
        for index in layers_to_mark(len(layers), instance.config, num_layers_option):
            mlp = getattr(layers[index], "mlp", None)
            if mlp is not None:
                mark_mlp(mlp)
        return result

    return wrapper


def stack_init_marking_layers(num_layers_option: int | None):
    """HybridStack.__init__ wrapper: marks the MLPs of the first N layers that hold one ('-' and 'E'; all without
    N), less those megatron recomputes whole (--recompute-method block counts every layer of the stack)."""
    from mm_adaptor.patches.transformer.hybrid_stack import mlp_layer_indices

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        layers = list(getattr(instance, "layers", []))
        with_mlp = mlp_layer_indices(layers)
        chosen = with_mlp if num_layers_option is None else with_mlp[:num_layers_option]
        recomputed_whole = set(range(layers_to_mark(len(layers), instance.config, None).start))
        for index in chosen:
            if index not in recomputed_whole:
                mark_mlp(layers[index].mlp)
        return result

    return wrapper
