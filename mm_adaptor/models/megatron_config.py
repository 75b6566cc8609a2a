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
    ) | dict(c.extra)  # the caller's extra wins (the trainer's: Megatron's fusion and recompute settings)


def stage_split(c) -> list[int]:
    """Language layers per pipeline stage: c.pipeline_layers, or megatron's even split. ValueError names a split
    that is not pipeline_model_parallel_size stages of c.num_layers in all, or whose middle stages differ (megatron
    takes a first and a last stage size, the rest even)."""
    pp = c.pipeline_model_parallel_size
    if c.pipeline_layers is None:
        if c.num_layers % pp:
            raise ValueError(f"{c.num_layers} language layers do not split evenly over {pp} pipeline stages; "
                             "give pipeline_layers")
        return [c.num_layers // pp] * pp
    split = list(c.pipeline_layers)
    if len(split) != pp or sum(split) != c.num_layers:
        raise ValueError(f"pipeline_layers {split} must give {pp} stages {c.num_layers} layers in all")
    if len(set(split[1:-1])) > 1:
        raise ValueError(f"pipeline_layers {split}: the middle stages must hold as many layers each")
    return split


def uneven_stages(c) -> dict:
    """The TransformerConfig fields of c.pipeline_layers (none for megatron's even split)."""
    if c.pipeline_layers is None or c.pipeline_model_parallel_size == 1:
        return {}
    split = stage_split(c)
    return dict(num_layers_in_first_pipeline_stage=split[0], num_layers_in_last_pipeline_stage=split[-1])
