"""The harness runner's model: megatron-core's GPT on the local spec (or its HybridModel), or a family's model,
one chunk per virtual stage, wrapped in DDP (and Float16Module), and its optimizer. Imports torch and megatron only
when called."""

from __future__ import annotations

from mm_adaptor.train.model import ffn_hidden_size, gpt_chunk, loss_func  # noqa: F401  (callers read them here)


def transformer_config(args):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32)
    ffn = ffn_hidden_size(args)
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=ffn,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention or args.num_query_groups else None,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        sequence_parallel=args.sequence_parallel,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        use_cpu_initialization=True,
        perform_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        calculate_per_token_loss=True,
        cuda_graph_scope=[],  # megatron's default "full" is deprecated and warns on every config
        deallocate_pipeline_outputs=True,
        # as Megatron-LM: the interleaved schedule overlaps its point-to-point transfers, unbatched. Batched, both
        # kinds of transfer between the same two ranks (PP2) would be matched by posting order and swapped.
        overlap_p2p_comm=interleaved,
        batch_p2p_comm=not interleaved,
    )
    if args.num_experts:
        kwargs.update(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size or ffn,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_grouped_gemm=args.moe_grouped_gemm,
            moe_router_dtype="fp32",
        )
    return TransformerConfig(**kwargs)


def build_model(args, config, device):
    """The model chunks of this rank on `device` (initialised on the host, so every device starts alike): the GPT,
    or with --hybrid-layer-pattern megatron's HybridModel."""
    return per_virtual_stage(args, device, lambda **stage: gpt_chunk(args, config, vocab_size=args.vocab_size,
                                                                      **stage))


def per_virtual_stage(args, device, make):
    """One chunk per virtual pipeline stage (one without VPP): make(...) with the stage's pre/post process."""
    from megatron.core import parallel_state as ps

    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(make(
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            vp_stage=stage,
        ).to(device))
    return chunks


def wrap_model(args, config, chunks):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=True,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        module = Float16Module(config, chunk) if (args.bf16 or args.fp16) else chunk
        wrapped.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                               disable_bucketing=i > 0))
    for chunk in wrapped:
        chunk.broadcast_params()
    return wrapped


def build_optimizer(args, config, model, **optimizer_config):
    """Megatron's optimizer and scheduler; optimizer_config: further OptimizerConfig fields (benchmarks compare
    e.g. optimizer_cpu_offload)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16, params_dtype=config.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer,
        loss_scale=None, initial_loss_scale=2.0**16 if args.fp16 else None, **optimizer_config,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    decay_iters = max(1, args.train_iters)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=decay_iters * args.global_batch_size, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=decay_iters * args.global_batch_size,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def connect_grad_sync(args, config, model) -> None:
    """Hand megatron's schedules the hooks that overlap gradient reduction and parameter gathering."""
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    single = len(model) == 1
    if args.overlap_grad_reduce:
        config.no_sync_func = [c.no_sync for c in model]
        config.grad_sync_func = [c.start_grad_sync for c in model]
        if single:
            config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]
    if args.overlap_param_gather:
        config.param_sync_func = [c.start_param_sync for c in model]
        if single:
            config.param_sync_func = config.param_sync_func[0]
