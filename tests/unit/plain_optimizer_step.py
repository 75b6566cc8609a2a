"""The reference side of the optimizer-state unit tests: the plain optimizer's step on the same random gradients."""

import torch


def plain_step_on_shared_grads(ref, ref_params, params, models_ref, generator) -> None:
    """Gives ref_params and params the same random gradients, steps ref, and copies each of the first
    len(models_ref) ref_params into its bf16 model, as megatron does after its step."""
    for a, b in zip(ref_params, params, strict=True):
        a.grad = torch.randn(a.shape, generator=generator)
        b.grad = a.grad.clone()
    ref.step()
    for model, main in zip(models_ref, ref_params):
        model.copy_(main.detach())
