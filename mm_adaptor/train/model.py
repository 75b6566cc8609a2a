"""What the trainer and the harness's runner build alike: the GPT (or HybridModel) chunk of one pipeline stage on
megatron-core's local spec from a TransformerConfig, and the loss megatron's schedules reduce. Imports torch and
megatron only when called."""

from __future__ import annotations

import argparse


def ffn_hidden_size(args: argparse.Namespace) -> int:
    """--ffn-hidden-size, or the tiny GPT's default: 4 x hidden, or with --swiglu 8/3 x hidden rounded up to a
    multiple of 64."""
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    if args.swiglu:
        return (int(args.hidden_size * 8 / 3) + 63) // 64 * 64
    return 4 * args.hidden_size


def loss_func(loss_mask, output_tensor):
    """What megatron's schedules reduce (calculate_per_token_loss): the loss summed over the tokens `loss_mask`
    keeps, their count, and the pair to log."""
    import torch

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def gpt_chunk(args, config, *, vocab_size: int, pre_process: bool, post_process: bool, vp_stage=None):
    """One (virtual) stage of the GPT on the local spec, or with --hybrid-layer-pattern megatron's HybridModel
    (mm_adaptor.train.hybrid), built on the host (so every device starts alike)."""
    if getattr(args, "hybrid_layer_pattern", None) is not None:
        from mm_adaptor.train import hybrid

        make = hybrid.model_factory(args, config)
    else:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
                                        qk_layernorm=getattr(args, "qk_layernorm", False),
                                        normalization=args.normalization)

        def make(**kwargs):
            return GPTModel(config=config, transformer_layer_spec=spec, **kwargs)
    extra = {}
    if getattr(args, "rotary_base", None) is not None:
        extra["rotary_base"] = args.rotary_base
    return make(vocab_size=vocab_size, max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                post_process=post_process, parallel_output=True,
                share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                vp_stage=vp_stage, **extra)
