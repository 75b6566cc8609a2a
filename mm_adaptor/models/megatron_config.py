"""What every family's megatron TransformerConfigs share: the dtype by name, activations by HF name, and the
fields common to every tower (layout, precision, no dropout, no fusions the local spec lacks, the caller's extra)."""

from __future__ import annotations


def dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def gelu_tanh(x):
    """transformers' gelu_pytorch_tanh (a named function: TransformerConfigs are saved with checkpoints)."""
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh")


ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu")


def activation(name: str):
    import torch.nn.functional as F

    return {"gelu_pytorch_tanh": gelu_tanh, "gelu": F.gelu, "silu": F.silu}[name]


def common_fields(c, normalization: str) -> dict:
    """c: a family's config dataclass (tensor_model_parallel_size, params_dtype, extra)."""
    params_dtype = dtype(c.params_dtype)
    return dict(
        tensor_model_parallel_size=c.tensor_model_parallel_size,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=c.params_dtype == "bfloat16",
        fp16=c.params_dtype == "float16", use_cpu_initialization=True, normalization=normalization,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False, cuda_graph_scope=[],
        **c.extra,
    )
