"""What mm_adaptor.versions.known_bugs refuses is wrong in unpatched megatron-core itself, on the installed release:
megatron-core < 0.19 at expert tensor-parallel size 1 < TP 2 with EP 1 reduces the experts' gradients over the
dense data-parallel ranks alone, so the tensor-parallel peers' copies of one expert get different gradients; from
0.19 they agree. Run on both legs: the refusal must cover exactly the releases where the peers disagree."""

import pytest
import torch

from mm_adaptor.harness import runner
from mm_adaptor.versions import known_bugs

pytestmark = pytest.mark.distributed

EXPERT_TP_1_BELOW_TP_2 = ["--num-layers", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--num-experts", "4", "--disable-bias-linear", "--expert-tensor-parallel-size", "1",
                          "--nproc-per-node", "4", "--train-iters", "1"]


def test_expert_tp_below_tp_at_ep_1_is_refused_exactly_where_megatron_trains_it_wrongly(monkeypatch):
    args = runner.parse_args(EXPERT_TP_1_BELOW_TP_2)
    problem = known_bugs.expert_gradient_problem(2, 1, 1)
    if problem:
        with pytest.raises(runner.LayoutError, match="NVIDIA/Megatron-LM #5916"):
            runner.check_args(args, 4)
    monkeypatch.setattr(known_bugs, "expert_gradient_problem", lambda *_, **__: None)  # run what megatron does
    dump = runner.run(args)
    assert [r.expert_layout["etp_size"] for r in dump.ranks] == [1] * 4
    experts = sorted(name for name in dump.ranks[0].grads[0] if ".experts.local_experts." in name)
    assert experts
    # ranks 0 and 1 are tensor-parallel peers holding the same whole experts (expert data-parallel size 4)
    peers_agree = all(torch.equal(dump.ranks[0].grads[0][n], dump.ranks[1].grads[0][n]) for n in experts)
    assert peers_agree == (problem is None), (problem, peers_agree)
