"""--use-flash-attn with attention dropout in training: the masks come from megatron's RNG streams (its tracker's
fork without sequence parallelism, the default stream with it), so full activation recompute reproduces the run
without recompute bit for bit; and the dropout really drops (the losses differ from --attention-dropout 0)."""

import pytest
import torch

from mm_adaptor.harness import runner as train
from mm_adaptor.harness import LAYOUTS

pytestmark = pytest.mark.distributed

MODEL = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--use-flash-attn"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


def run(*extra):
    dump = train.run(train.parse_args([*MODEL, *extra, "--train-iters", "3", "--timeout", "300"]))
    assert "flash-attn" in dump.features
    return dump


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp"])
def test_full_recompute_reproduces_flash_attention_dropout(layout):
    plain = run(*LAYOUTS[layout], "--attention-dropout", "0.1")
    recomputed = run(*LAYOUTS[layout], "--attention-dropout", "0.1", *RECOMPUTE)
    assert plain.losses == recomputed.losses
    for a, b in zip(plain.ranks, recomputed.ranks):
        for step_a, step_b in zip(a.grads, b.grads):
            for name, grad in step_a.items():
                assert torch.equal(grad, step_b[name]), name
    no_dropout = run(*LAYOUTS[layout], "--attention-dropout", "0")
    assert plain.losses[0] != no_dropout.losses[0], "attention dropout must change the loss"
