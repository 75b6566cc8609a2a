"""--context-parallel-size N --context-parallel-algo ulysses_cp_algo | megatron_cp_algo | hybrid_cp_algo
[--ulysses-degree-in-cp U] (MindSpeed's names): context parallelism on the local spec, whose DotProductAttention
megatron-core builds only at CP 1."""

from mm_adaptor.core.features import Feature, Flag, Tolerance, refuse_unless_local_spec, register
from mm_adaptor.core.verification import (
    BASE_RELEASE, CP2_RING, NO_GPU, ON_0_19_2, fake_npu_check, same_everywhere,
)

SIZE, ALGO, ULYSSES = "--context-parallel-size", "--context-parallel-algo", "--ulysses-degree-in-cp"
ALGOS = ("ulysses_cp_algo", "megatron_cp_algo", "hybrid_cp_algo")
ATTENTION = "megatron.core.transformer.dot_product_attention.DotProductAttention"


@register
class ContextParallel(Feature):
    name = "context-parallel"
    verified_on = {"0.16.1": BASE_RELEASE, "0.19.0": ON_0_19_2}
    devices = same_everywhere(NO_GPU, fake_npu_check(CP2_RING))
    refusal_probes = (
        ("Ulysses with heads that do not divide", {"context_parallel_size": 2, "context_parallel_algo":
                                                   "ulysses_cp_algo", "num_attention_heads": 3}),
        ("with attention dropout", {"context_parallel_size": 2, "attention_dropout": 0.1}),
    )
    description = ("the sequence is split over N context-parallel ranks (megatron's load-balanced halves: rank r "
                   "holds chunks r and 2N-1-r) and the local spec's causal core attention runs over the group: "
                   "ulysses_cp_algo (an all-to-all from sequence to heads around whole-sequence attention), "
                   "megatron_cp_algo (a ring: keys and values passed around, blocks merged by their log-sum-exp; "
                   "backward passes them again with their gradients), hybrid_cp_algo (Ulysses over "
                   f"{ULYSSES} consecutive ranks, the ring across them); megatron's rope offsets, loss and "
                   "gradient reduction over data x context ranks serve it")
    flags = (
        Flag(SIZE, "context-parallel ranks (megatron's flag; 1: none)", type=int, default=1, megatron_owned=True),
        Flag(ALGO, "how the core attention runs across them (MindSpeed's names)", type=str, choices=ALGOS,
             default="megatron_cp_algo"),
        Flag(ULYSSES, f"with {ALGO} hybrid_cp_algo: the Ulysses degree (a divisor of {SIZE}, between 2 and it / 2)",
             type=int, default=None),
    )
    tolerance = Tolerance(exact=False, factor=2.0,
                          why="attention blocks in fp32 merged by log-sum-exp, and each weight gradient summed over "
                              "half the tokens per rank, then over the ranks: two roundings where megatron has one "
                              "(bf16 measured 1.05 x the calibrated noise at a layer norm's bias, hence x2)")

    splits_sequence = True

    def __init__(self):
        self.calls: dict[str, int] = {}  # core-attention calls by algorithm: the check shows the mechanism ran

    def is_enabled(self, options) -> bool:
        return (getattr(options, "context_parallel_size", 1) or 1) > 1 or \
            getattr(options, "ulysses_degree_in_cp", None) is not None

    def validate(self, options):
        refuse_unless_local_spec(self, options, refusal_for(options))

    def statistics(self):
        return {f"{algo} attention calls": n for algo, n in sorted(self.calls.items())} or None

    def patch_sets(self, options):
        from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE, Contract, PatchSet
        from mm_adaptor.patches.transformer import context_parallel as cp

        contract = Contract(versions=SUPPORTED_MEGATRON_CORE)
        ps = PatchSet(self.name)
        ps.wrap(f"{ATTENTION}.__init__", cp.init_with_context_parallel, contract=contract)
        ps.wrap(f"{ATTENTION}.forward", self.forward(options), contract=contract)
        return [ps]

    def forward(self, options):
        from mm_adaptor.patches.transformer import context_parallel as cp

        return cp.forward_with_context_parallel(options.context_parallel_algo, ulysses_degree(options), self.calls)


def ulysses_degree(options) -> int:
    size = getattr(options, "context_parallel_size", 1) or 1
    algo = getattr(options, "context_parallel_algo", "megatron_cp_algo")
    return {"ulysses_cp_algo": size, "megatron_cp_algo": 1}.get(algo) or options.ulysses_degree_in_cp


def refusal_for(options) -> str | None:
    """One line naming what context parallelism cannot serve, or None."""
    size = getattr(options, "context_parallel_size", 1) or 1
    algo = getattr(options, "context_parallel_algo", "megatron_cp_algo")
    u = getattr(options, "ulysses_degree_in_cp", None)
    if size == 1:
        return f"{ULYSSES} needs {SIZE} 2 or more" if u is not None else None
    if algo == "hybrid_cp_algo":
        if u is None or not 1 < u < size or size % u:
            return (f"{ALGO} hybrid_cp_algo needs {ULYSSES} U with 1 < U < {size} dividing {SIZE} {size} "
                    f"(e.g. {ULYSSES} 2 at {SIZE} 4)")
    elif u is not None:
        return f"{ULYSSES} is read by {ALGO} hybrid_cp_algo only: drop it or use hybrid_cp_algo"
    tp = getattr(options, "tensor_model_parallel_size", 1) or 1
    heads = getattr(options, "num_attention_heads", None)
    groups = getattr(options, "num_query_groups", None) if getattr(options, "group_query_attention", False) else None
    degree = {"ulysses_cp_algo": size, "hybrid_cp_algo": u}.get(algo, 1)
    for what, count in (("--num-attention-heads", heads), ("--num-query-groups", groups)):
        if degree > 1 and count is not None and (count // tp) % degree:
            return (f"{ALGO} {algo} splits each tensor-parallel rank's heads over {degree} ranks: {what} {count} / "
                    f"--tensor-model-parallel-size {tp} is not divisible by {degree}; use megatron_cp_algo or other "
                    f"head counts")
    seq = getattr(options, "seq_length", None)
    if seq is not None and seq % (2 * size):
        return f"--seq-length {seq} is not divisible by 2 x {SIZE} {size} (each rank holds two equal chunks)"
    if (getattr(options, "attention_dropout", 0.0) or 0.0) > 0:
        return (f"{SIZE} {size} on the local spec has no attention dropout: pass --attention-dropout 0 (Megatron-LM's "
                "default is 0.1)")
    if getattr(options, "apply_query_key_layer_scaling", False):
        return f"{SIZE} {size} on the local spec does not implement --apply-query-key-layer-scaling: drop it"
    if getattr(options, "reset_attention_mask", False):
        return (f"{SIZE} {size} attends causally over the whole sequence; --reset-attention-mask's document "
                "masks are not served: drop one of them")
    for flag, dest in (("--use-flash-attn", "use_flash_attn"), ("--swap-attention", "swap_attention")):
        if getattr(options, dest, False):
            return f"{flag} and {SIZE} {size} both replace the local spec's core attention: keep one"
    return None

