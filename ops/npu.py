"""Ascend NPU implementations through torch_npu's fused kernels, registered for the PrivateUse1 key.
Not verified on NPU hardware (none is available where this was written)."""

from __future__ import annotations


def register(impl_lib) -> dict:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return {"native": False, "why": "torch_npu is not installed"}
    import torch

    def rms_norm_fwd(x, weight, eps):
        y, rstd = torch_npu.npu_rms_norm(x, weight, epsilon=eps)
        return y, rstd.reshape(-1).float()

    def swiglu_fwd(x):
        return torch_npu.npu_swiglu(x, dim=-1)

    def rotary_pos_emb_fwd(t, freqs, interleaved):
        if interleaved:
            from mm_adaptor.ops.reference import rotary_pos_emb_fwd as reference

            return reference(t, freqs, interleaved)
        rot = freqs.shape[-1]
        cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
        rotated = torch_npu.npu_rotary_mul(t[..., :rot], cos, sin)
        return torch.cat([rotated, t[..., rot:]], dim=-1)

    def grouped_matmul_fwd(x, weights, tokens_per_expert):
        return torch_npu.npu_grouped_matmul([x], [weights], group_list=tokens_per_expert.cumsum(0).tolist(),
                                            split_item=2)[0]

    from mm_adaptor.ops import reference

    kernels = {
        "rms_norm_fwd": rms_norm_fwd, "rms_norm_bwd": reference.rms_norm_bwd,
        "swiglu_fwd": swiglu_fwd, "swiglu_bwd": reference.swiglu_bwd,
        "rotary_pos_emb_fwd": rotary_pos_emb_fwd, "rotary_pos_emb_bwd": reference.rotary_pos_emb_bwd,
        "matmul_add_fp32": reference.matmul_add_fp32,
        "grouped_matmul_fwd": grouped_matmul_fwd, "grouped_matmul_bwd": reference.grouped_matmul_bwd,
    }
    for name, fn in kernels.items():
        impl_lib.impl(name, fn, "PrivateUse1")
    return {"native": True, "why": "torch_npu fused kernels (not verified on NPU hardware)"}
