"""--moe-zero-memory's bookkeeping without ranks: which layers take which level, and the re-dispatched input held
exactly while a saved view still needs it (tests/distributed/test_moe_zero_memory.py checks the numbers)."""

from collections import Counter

import pytest
import torch

from mm_adaptor.patches.transformer import moe_zero_memory as zm


def test_level1_in_the_first_n_moe_layers_level0_after():
    assert zm.levels_for(3, "level0", None) == ["level0"] * 3
    assert zm.levels_for(3, "level1", None) == ["level1"] * 3
    assert zm.levels_for(3, "level1", 1) == ["level1", "level0", "level0"]
    assert zm.levels_for(2, "level1", 0) == ["level0", "level0"]


class Dispatched(zm.Redispatch):
    def __init__(self):
        super().__init__(None, torch.zeros(1), None, None, {}, Counter())
        self.data = torch.arange(12.0).reshape(6, 2)

    def dispatch_again(self):
        return self.data.clone()


def test_the_input_is_dispatched_once_and_let_go_when_the_last_view_has_it():
    source = Dispatched()
    base = source.data
    views = [zm.Redispatched(source, base[:2]), zm.Redispatched(source, base[2:])]
    source.pending = len(views)
    source.before_experts_backward(None)  # the experts' output gradient: every rank dispatches here
    assert source.statistics["experts' inputs dispatched again"] == 1 and source.delivered is not None
    assert torch.equal(views[1].unpack(), base[2:]) and source.delivered is not None
    assert torch.equal(views[0].unpack(), base[:2])
    assert source.delivered is None, "held after every saved view had it"
    with pytest.raises(RuntimeError, match="asked for again"):
        views[0].unpack()  # never a second dispatch on this rank alone
    assert source.statistics["experts' inputs dispatched again"] == 1


def test_a_rank_that_saved_none_of_it_still_dispatches_and_keeps_nothing():
    source = Dispatched()
    source.before_experts_backward(None)
    assert source.statistics["experts' inputs dispatched again"] == 1 and source.delivered is None


def test_the_experts_output_hook_after_the_last_view_does_nothing():
    """One local expert: its fc2 output is the layer's expert output, and the recompute hook registered on it first
    unpacks (and lets go) before this hook runs."""
    source = Dispatched()
    view = zm.Redispatched(source, source.data)
    source.pending = 1
    view.unpack()
    source.before_experts_backward(None)
    assert source.statistics["experts' inputs dispatched again"] == 1 and source.delivered is None
