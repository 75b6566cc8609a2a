"""--balanced-moe-experts without ranks: its refusals, the hot-expert choice, and what a choice changes per EP rank
(tests/distributed/test_balanced_moe_experts.py checks the numbers against unpatched Megatron)."""

import argparse

import pytest
import torch

from mm_adaptor.core.features import FeatureConfigError, get
from mm_adaptor.feature_flags.balanced_moe_experts import refusal_for
from mm_adaptor.patches.transformer import balanced_moe_experts as bm

BASE = {"balanced_moe_experts": True, "num_experts": 4, "expert_model_parallel_size": 2,
        "moe_token_dispatcher_type": "alltoall"}


def options(**changes):
    return argparse.Namespace(**{**BASE, **changes})


def test_a_served_configuration_is_accepted():
    assert refusal_for(options()) is None
    assert refusal_for(options(balanced_moe_hot_expert_num=1, trans_hot_expert_group_num=1,
                               balanced_moe_update_interval=4, moe_token_dispatcher_type="allgather")) is None
    assert refusal_for(options(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)) is None
    # --moe-tp-extend-ep: megatron's expert TP 1 and EP TP x the user's
    assert refusal_for(options(tensor_model_parallel_size=2, expert_model_parallel_size=1,
                               moe_tp_extend_ep=True)) is None
    assert refusal_for(options(recompute_granularity="full", recompute_method="uniform")) is None  # K 1


@pytest.mark.parametrize("changes, words", [
    ({"num_experts": None}, "add --num-experts"),
    ({"balanced_moe_hot_expert_num": 0}, "outside 1 .. 3"),
    ({"balanced_moe_hot_expert_num": 4}, "outside 1 .. 3"),
    ({"num_experts": 2}, "--balanced-moe-hot-expert-num 3 is outside 1 .. 1"),  # MindSpeed's default N 3
    ({"balanced_moe_update_interval": 0}, "--balanced-moe-update-interval 0"),
    ({"trans_hot_expert_group_num": 3}, "give --trans-hot-expert-group-num 1 or drop it"),
    ({"expert_model_parallel_size": 1}, "--expert-model-parallel-size 2 or more"),
    ({"moe_token_dispatcher_type": "flex"}, "not flex"),
    ({"tensor_model_parallel_size": 2}, "expert tensor parallelism 2"),
    ({"expert_tensor_parallel_size": 2}, "expert tensor parallelism 2"),
    ({"moe_expert_capacity_factor": 1.0}, "dropless only"),
    ({"moe_pad_expert_input_to_capacity": True}, "dropless only"),
    ({"balanced_moe_update_interval": 2, "recompute_granularity": "full"}, "recomputed MoE layer"),
    ({"balanced_moe_update_interval": 2, "recompute_granularity": "selective", "recompute_modules": ["moe"]},
     "recomputed MoE layer"),
    ({"moe_zero_memory": "level0"}, "drop --moe-zero-memory or drop --balanced-moe-experts"),
    ({"moe_alltoall_overlap_comm": True}, "drop --moe-alltoall-overlap-comm"),
    ({"overlap_moe_expert_parallel_comm": True}, "drop --overlap-moe-expert-parallel-comm"),
    ({"moe_latent_size": 16}, "drop --moe-latent-size"),
    ({"delay_wgrad_compute": True}, "drop --delay-wgrad-compute"),
    ({"balanced_moe_experts": False, "balanced_moe_hot_expert_num": 2}, "add --balanced-moe-experts"),
])
def test_refusals_name_the_flags_and_the_fix(changes, words):
    refusal = refusal_for(options(**changes))
    assert refusal and words in refusal and "\n" not in refusal, refusal


def test_grouped_gemms_refused_only_where_megatron_builds_grouped_mlp():
    from megatron.core.transformer.moe import experts

    refusal = refusal_for(options(moe_grouped_gemm=True))
    assert (refusal is not None) == hasattr(experts, "GroupedMLP"), refusal


def test_validate_raises_and_a_tuning_flag_alone_counts_as_asking():
    feature = get("balanced-moe-experts")
    alone = argparse.Namespace(balanced_moe_hot_expert_num=2, num_experts=4)
    assert feature.is_enabled(alone)
    with pytest.raises(FeatureConfigError, match="add --balanced-moe-experts"):
        feature.validate(alone)
    with pytest.raises(FeatureConfigError, match="--transformer-impl local"):
        feature.validate(options(transformer_impl="transformer_engine"))
    assert not feature.is_enabled(argparse.Namespace())


def test_the_hottest_experts_over_the_group_ties_to_the_lower_index():
    counts = torch.tensor([[5, 0, 9, 1], [5, 3, 0, 2]])  # totals 10, 3, 9, 3
    assert bm.select_hot(counts, 1) == [0]
    assert bm.select_hot(counts, 2) == [0, 2]
    assert bm.select_hot(counts, 3) == [0, 1, 2]  # 1 and 3 tie at 3: the lower index
    assert bm.select_hot(torch.zeros(2, 4, dtype=torch.long), 2) == [0, 1]


def test_owners_and_what_a_choice_changes_per_rank():
    assert [bm.owner_of(e, 2) for e in range(4)] == [0, 0, 1, 1]
    # rank 0 routes 6 rows to expert 0 and 4 to expert 2; rank 1 routes 6 to expert 0 and 2 to expert 3
    counts = torch.tensor([[6, 0, 4, 0], [6, 0, 0, 2]])
    unbalanced = bm.balance(counts, [], 2)
    assert unbalanced == {"rows": [12, 6], "sent": [4, 6]}
    balanced = bm.balance(counts, [0], 2)  # expert 0 copied: each rank computes its own 6 rows
    assert balanced == {"rows": [6, 12], "sent": [4, 0]}
    assert sum(balanced["rows"]) == sum(unbalanced["rows"]) == counts.sum()


def test_the_hot_output_joins_after_postprocess_once():
    class Layer:
        pass

    layer = Layer()
    layer.__dict__[bm.STATE_ATTR] = bm.LayerState(pending=torch.ones(4, 2))
    out = bm.postprocess_adding_hot_output(lambda *a, **k: torch.zeros(2, 2, 2), layer, (), {})
    assert torch.equal(out, torch.ones(2, 2, 2)) and layer.__dict__[bm.STATE_ATTR].pending is None
    again = bm.postprocess_adding_hot_output(lambda *a, **k: torch.zeros(2, 2, 2), layer, (), {})
    assert torch.equal(again, torch.zeros(2, 2, 2))


def test_the_alltoall_dispatcher_permutes_only_the_cold_rows():
    class Dispatcher:
        num_out_tokens = 12

    d = Dispatcher()
    bm.alltoall_preprocess_counting_rows(lambda *a: None, d, (None,), {})
    assert d.num_out_tokens == 12  # not balancing: megatron's tokens x top-k
    d.__dict__[bm.OUT_TOKENS_ATTR] = 7
    bm.alltoall_preprocess_counting_rows(lambda *a: None, d, (None,), {})
    assert d.num_out_tokens == 7
