"""--use-coc on the newest megatron-core (collected only on 0.17 or newer): it serves, the linears' and the MoE
layer's functions being core_v0.19.0's; the 0.16 regression tests of tests/distributed/test_coc.py run here too
(pytest collects the imported ones): bit for bit in TP2 with sequence parallelism (fp32 N=2, bf16 N=4) and without
it (all-reduce, uneven chunks), within the calibrated tolerance for EP2 x expert TP2 MoE through 0.19's MoE layer
and all-to-all dispatcher, each time with the chunked paths counted as run; chunks re-assembled in the wrong order
(tests/distributed/broken_coc_feature.py) fail the same comparison."""

import sys
from pathlib import Path

import pytest

from mm_adaptor import versions

# the 0.16 regression test and its broken variant; the training ranks import the variant from the same path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from test_coc import (test_chunks_in_the_wrong_order_fail, test_ep2_with_tensor_parallel_experts,  # noqa: E402,F401
                      test_tp2_all_reduce_with_uneven_chunks, test_tp2_sequence_parallel)

pytestmark = pytest.mark.distributed


def test_coc_serves_on_this_release():
    state = {s.name: s for s in versions.feature_states()}["coc"]
    assert not state.refusals, state.refusals
