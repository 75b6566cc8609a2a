"""--moe-tp-extend-ep without ranks: Megatron's arguments it is expressed in (once, from the user's values), its
one-line refusals, and the harness's whole-expert view (harness.expert_view.assemble_experts), which puts experts
sliced over expert-TP ranks and whole experts on other ranks under one global name each
(tests/distributed/test_moe_tp_extend_ep.py checks the runs)."""

import argparse

import pytest
import torch

from mm_adaptor.core import features
from mm_adaptor.core.features import FeatureConfigError
from mm_adaptor.harness import verdict

FEATURE = "moe-tp-extend-ep"


def options(**given):
    values = dict(moe_tp_extend_ep=True, num_experts=8, tensor_model_parallel_size=2, expert_model_parallel_size=1,
                  expert_tensor_parallel_size=None, sequence_parallel=True)
    values.update(given)
    return features.fill_defaults(argparse.Namespace(**values))


def express(opts):
    return features.express_in_megatron_arguments(opts, features.enabled_features(opts))


@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2), (4, 2)])
def test_tp_x_ep_expert_parallel_ranks_with_whole_experts(tp, ep):
    opts = options(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    features.get(FEATURE).validate(opts)
    assert express(opts) == {"expert_tensor_parallel_size": None, "expert_model_parallel_size": ep}
    assert (opts.expert_tensor_parallel_size, opts.expert_model_parallel_size) == (1, tp * ep)
    assert opts.tensor_model_parallel_size == tp, "attention stays TP-sliced"
    express(opts)  # a second call (every argument check calls it) changes nothing
    assert opts.expert_model_parallel_size == tp * ep
    features.get(FEATURE).validate(opts)  # validate reads the user's values, also once rewritten
    assert features.users_value(opts, "expert_model_parallel_size") == ep


def test_an_explicit_expert_tp_of_1_is_the_same_layout():
    opts = options(expert_tensor_parallel_size=1, expert_model_parallel_size=2)
    features.get(FEATURE).validate(opts)
    express(opts)
    assert (opts.expert_tensor_parallel_size, opts.expert_model_parallel_size) == (1, 4)


def test_off_rewrites_nothing():
    opts = options(moe_tp_extend_ep=False, expert_model_parallel_size=2)
    assert express(opts) == {} and opts.expert_model_parallel_size == 2
    assert not hasattr(opts, features.USERS_ARGUMENTS)


@pytest.mark.parametrize("given, words", [
    (dict(tensor_model_parallel_size=1), "--tensor-model-parallel-size is 1 (nothing to extend)"),
    (dict(num_experts=None), "the model has none: add --num-experts"),
    (dict(expert_tensor_parallel_size=2), "--expert-tensor-parallel-size 2 asks to slice them"),
    (dict(num_experts=6, expert_model_parallel_size=2), "--num-experts 6 does not divide over "
                                                        "--tensor-model-parallel-size 2 x --expert-model-parallel-size"
                                                        " 2 = 4"),
    (dict(sequence_parallel=False), "add --sequence-parallel"),
])
def test_refusals_are_one_line_and_rewrite_nothing(given, words):
    opts = options(**given)
    with pytest.raises(FeatureConfigError) as refused:
        features.get(FEATURE).validate(opts)
    assert words in str(refused.value) and "\n" not in str(refused.value)
    ep = opts.expert_model_parallel_size
    assert express(opts) == {} and opts.expert_model_parallel_size == ep


def test_the_harness_refuses_before_any_rank_starts():
    from mm_adaptor.harness import compare as _  # noqa: F401
    import sys

    compare = sys.modules["mm_adaptor.harness.compare"]
    with pytest.raises(compare.HarnessError, match="nothing to extend"):
        compare.checked_args(["--num-layers", "2", "--num-experts", "4", "--moe-tp-extend-ep"], check_devices=False)
    args = compare.checked_args(["--num-layers", "2", "--num-experts", "4", "--tensor-model-parallel-size", "2",
                                 "--sequence-parallel", "--nproc-per-node", "4", "--expert-model-parallel-size", "2",
                                 "--moe-tp-extend-ep"], check_devices=False)
    layout = compare._finalized(args)
    assert (layout.expert_tensor_parallel_size, layout.expert_model_parallel_size) == (1, 4)
    # a layout error after the rewrite names megatron's sizes, not an --expert-model-parallel-size 4 never typed
    with pytest.raises(compare.HarnessError) as refused:
        compare._finalized(compare.checked_args(
            ["--num-layers", "2", "--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--nproc-per-node", "4", "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--disable-bias-linear", "--moe-tp-extend-ep"], check_devices=False))
    assert "expert-parallel size 4" in str(refused.value) and "--expert-model-parallel-size 4" not in str(refused.value)


def _rank(rank, layout, tensors):
    from mm_adaptor.harness.runner import RankDump

    return RankDump(rank=rank, losses=[1.0], grad_norms=[None], grads=[tensors], params=tensors,
                    initial_params=tensors, expert_layout=layout)


def _layout(ep_rank, ep_size, etp_rank, etp_size, glu=True):
    return dict(num_experts=4, glu=glu, ep_rank=ep_rank, ep_size=ep_size, etp_rank=etp_rank, etp_size=etp_size,
                pp_rank=0)


EXPERT = "chunk0.decoder.layers.0.mlp.experts.local_experts.{}.linear_fc{}.weight"


def _whole_experts(hidden=2, ffn=4):
    """Expert e: fc1 [gate; up] (2 ffn x hidden), fc2 (hidden x ffn), distinct values."""
    return {e: (torch.arange(2 * ffn * hidden, dtype=torch.float32).reshape(2 * ffn, hidden) + 100 * e,
                torch.arange(hidden * ffn, dtype=torch.float32).reshape(hidden, ffn) - 100 * e) for e in range(4)}


def _sliced_dump(experts, ffn=4):
    """TP2 x EP2 with expert TP 2 (4 ranks): rank = ep_rank * 2 + etp_rank, each holding 2 experts' halves
    (fc1 rows: its gate half then its up half; fc2 columns)."""
    from mm_adaptor.harness.runner import Dump

    ranks = []
    for ep_rank in range(2):
        for etp in range(2):
            tensors = {"chunk0.decoder.final_layernorm.weight": torch.ones(2)}
            for local in range(2):
                fc1, fc2 = experts[ep_rank * 2 + local]
                gate, up = fc1[:ffn], fc1[ffn:]
                half = slice(etp * ffn // 2, (etp + 1) * ffn // 2)
                tensors[EXPERT.format(local, 1)] = torch.cat([gate[half], up[half]])
                tensors[EXPERT.format(local, 2)] = fc2[:, half]
            ranks.append(_rank(ep_rank * 2 + etp, _layout(ep_rank, 2, etp, 2), tensors))
    return Dump(ranks=ranks)


def _whole_dump(experts):
    """The same experts under --moe-tp-extend-ep: expert TP 1, EP 4, one whole expert per rank."""
    from mm_adaptor.harness.runner import Dump

    return Dump(ranks=[_rank(r, _layout(r, 4, 0, 1), {"chunk0.decoder.final_layernorm.weight": torch.ones(2),
                                                      EXPERT.format(0, 1): experts[r][0],
                                                      EXPERT.format(0, 2): experts[r][1]})
                       for r in range(4)])


def test_sliced_and_whole_experts_assemble_to_the_same_global_tensors():
    experts = _whole_experts()
    sliced, whole = _sliced_dump(experts), _whole_dump(experts)
    assert verdict.expert_layouts_differ(sliced, whole)
    a, b = (verdict.assemble_experts(d, lambda r: r.params) for d in (sliced, whole))
    assert sorted(a) == sorted(b) == sorted(f"chunk0.decoder.layers.0.mlp.experts.global_experts.{e}.linear_fc{i}"
                                            f".weight" for e in range(4) for i in (1, 2))
    for key in a:
        assert torch.equal(a[key][1], b[key][1]), key
    assert a["chunk0.decoder.layers.0.mlp.experts.global_experts.3.linear_fc1.weight"][0] == 2  # first holder
    assert verdict.kind_of("chunk0.decoder.layers.0.mlp.experts.global_experts.3.linear_fc1.weight") == \
        "decoder.layers.*.mlp.experts.global_experts.*.linear_fc1.weight"


def test_the_whole_expert_verdict_passes_equal_experts_and_names_a_wrong_one():
    experts = _whole_experts()
    sliced, whole = _sliced_dump(experts), _whole_dump(experts)
    judged = verdict.judge(sliced, whole, verdict.Limits("fp32", None), whole_experts=True)
    assert not any(v.failures for v in judged.values()), {g: v.failures for g, v in judged.items()}
    assert judged["gradients"].count == 4 + 8  # the layer norm on each rank, 8 whole expert tensors
    # without assembling, the slices and whole experts do not even have the same shapes
    assert verdict.judge(sliced, whole, verdict.Limits("fp32", None))["gradients"].failures
    wrong = _whole_dump({**experts, 1: experts[2]})  # rank 1 holds expert 2's weights
    failures = verdict.judge(sliced, wrong, verdict.Limits("fp32", None), whole_experts=True)["gradients"].failures
    assert {f.split(":")[0] for f in failures} == {
        f"step 1 rank 0 chunk0.decoder.layers.0.mlp.experts.global_experts.1.linear_fc{i}.weight" for i in (1, 2)}


def test_same_layouts_keep_per_rank_points():
    experts = _whole_experts()
    assert not verdict.expert_layouts_differ(_whole_dump(experts), _whole_dump(experts))
    names = {p.name for p in verdict.points(_whole_dump(experts), _whole_dump(experts))}
    assert EXPERT.format(0, 1) in names and not any("global_experts" in n for n in names)
