"""--recompute-activation-function: one-line refusals, which layers of a block take part, and the mechanism on one
MLP (the output's storage released after fc2 saved it, refilled before fc2's backward, gradients unchanged)."""

import argparse

import pytest
import torch

import mm_adaptor
from refusals import assert_refused_in_one_line

from mm_adaptor.core.features import get


def options(**kw):
    base = dict(recompute_activation_function=True, recompute_activation_function_num_layers=None,
                transformer_impl="local")
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("kw,names", [
    (dict(recompute_activation_function=False, recompute_activation_function_num_layers=1),
     ["--recompute-activation-function-num-layers", "needs --recompute-activation-function"]),
    (dict(recompute_activation_function_num_layers=-1), ["--recompute-activation-function-num-layers -1"]),
    (dict(recompute_granularity="full", recompute_method="uniform"),
     ["--recompute-granularity full", "--recompute-method uniform"]),
    (dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe_act"]),
     ["moe_act", "--recompute-modules"]),
    (dict(transformer_impl="transformer_engine"), ["--transformer-impl local"]),
])
def test_refusals_are_one_line_naming_the_flags(kw, names):
    assert_refused_in_one_line("recompute-activation-function", options(**kw), names,
                               "N alone counts as asking, so that it can be refused")


@pytest.mark.parametrize("kw", [dict(), dict(recompute_activation_function_num_layers=0),
                                dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
                                dict(recompute_granularity="selective", recompute_modules=["core_attn"])])
def test_accepted(kw):
    get("recompute-activation-function").validate(options(**kw))


def test_layers_taking_part():
    from mm_adaptor.patches.transformer.recompute_activation import layers_to_mark

    plain = argparse.Namespace(recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    block = argparse.Namespace(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    assert list(layers_to_mark(4, plain, None)) == [0, 1, 2, 3]
    assert list(layers_to_mark(4, plain, 2)) == [0, 1]
    assert list(layers_to_mark(4, plain, 9)) == [0, 1, 2, 3]
    assert list(layers_to_mark(4, block, None)) == [1, 2, 3], "megatron recomputes layer 0 whole"
    assert list(layers_to_mark(4, block, 1)) == []
    assert list(layers_to_mark(4, block, 3)) == [1, 2]


@pytest.fixture
def recompute_on():
    mm_adaptor.enable(options())
    yield
    mm_adaptor.disable()


def test_one_mlp_releases_and_refills_the_activation(recompute_on):
    from megatron.core.transformer.mlp import MLP

    from mm_adaptor.patches.transformer.recompute_activation import RECOMPUTE_ATTR

    assert hasattr(MLP.forward, "__wrapped__")
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    seen = {}

    def fc2(h):
        seen["activation"] = h
        return h @ w2, None

    fake = type("FakeMLP", (torch.nn.Module,), {})()
    fake.config = argparse.Namespace(use_te_activation_func=False, bias_activation_fusion=False,
                                     gated_linear_unit=True, activation_func_clamp_value=None, glu_linear_offset=0.0,
                                     activation_func=torch.nn.functional.silu)
    fake.activation_func = torch.nn.functional.silu
    fake.linear_fc1 = _Fn(lambda h: (h @ w1.t(), None))
    fake.linear_fc2 = _Fn(fc2)
    x = torch.randn(3, 4)

    def grads_of(out):
        out.sum().backward()  # megatron's recompute refuses torch.autograd.grad
        grads = (w1.grad.clone(), w2.grad.clone())
        w1.grad = w2.grad = None
        return grads

    out_plain, _ = MLP.forward(fake, x)
    grads_plain = grads_of(out_plain)
    setattr(fake, RECOMPUTE_ATTR, True)
    out, _ = MLP.forward(fake, x)
    assert seen["activation"].untyped_storage().size() == 0, "released once fc2 has it"
    grads = grads_of(out)
    assert seen["activation"].untyped_storage().size() == 3 * 4 * 4, "refilled for fc2's backward"
    assert torch.equal(out, out_plain)
    for g, g_plain in zip(grads, grads_plain):
        assert torch.equal(g, g_plain)
    # an expert given no rows (--balanced-moe-experts computes every hot expert on every rank): the empty activation
    # shares the empty input's null data pointer, and must still be recomputed, not taken for a view of its input
    out, _ = MLP.forward(fake, x[:0])
    assert out.shape == (0, 4)
    (out.sum() + (x * 0).sum()).backward()
    assert w1.grad is None or not w1.grad.any()


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)
