"""CUDA graphs (megatron's --enable-cuda-graph, --external-cuda-graph, --cuda-graph-impl local|transformer_engine)
replay a captured step's allocations and copies; swap attention and the optimizer-state features move tensors at
run time, so each refuses them in one line naming both flags. The CLI turns the refusal into exit 2."""

import argparse
import math

import pytest
from refusals import assert_refused_in_one_line

from mm_adaptor.core.features import get

# each feature with options it otherwise accepts
ACCEPTED = {
    "swap-attention": dict(swap_attention=True, transformer_impl="local"),
    "reuse-fp32-param": dict(reuse_fp32_param=True, bf16=True),
    "swap-optimizer": dict(swap_optimizer=True, use_distributed_optimizer=True, bf16=True),
    "virtual-optimizer": dict(virtual_optimizer=math.inf),
}
GRAPHS = [(dict(enable_cuda_graph=True), "--enable-cuda-graph"),
          (dict(external_cuda_graph=True), "--external-cuda-graph"),
          (dict(cuda_graph_impl="local"), "--cuda-graph-impl local"),
          (dict(cuda_graph_impl="transformer_engine"), "--cuda-graph-impl transformer_engine")]


@pytest.mark.parametrize("feature", sorted(ACCEPTED))
@pytest.mark.parametrize("graph,graph_flag", GRAPHS, ids=[flag for _, flag in GRAPHS])
def test_refused_beside_cuda_graphs(feature, graph, graph_flag):
    opts = argparse.Namespace(**ACCEPTED[feature], **graph)
    assert_refused_in_one_line(feature, opts, [get(feature).main_flag.option, graph_flag])


@pytest.mark.parametrize("feature", sorted(ACCEPTED))
def test_accepted_without_graphs_and_without_the_flags_defined(feature):
    get(feature).validate(argparse.Namespace(**ACCEPTED[feature]))  # the built-in driver defines none of them
    get(feature).validate(argparse.Namespace(**ACCEPTED[feature], enable_cuda_graph=False, external_cuda_graph=False,
                                             cuda_graph_impl="none"))
