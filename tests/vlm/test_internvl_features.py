"""`mm-adaptor check --model internvl-tiny --FEATURE`: the features serve InternVL (InternViT with layer scale, the
pixel-shuffle projector, a Qwen2 language model with 1-D rope) within their declared tolerance against unpatched
Megatron, in the same three comparisons as Qwen2.5-VL (test_vlm_features.GROUPS: TP2 with sequence parallelism),
each member's wrappers seen running. Measured 2026-11-26: all three pass, 22 s + 5 s + 4 s."""

import pytest
from test_vlm_features import FEATURES, GROUPS, assert_group_serves

pytestmark = pytest.mark.distributed

INTERNVL = ["--model", "internvl-tiny", "--micro-batch-size", "1"]


@pytest.mark.parametrize("group", list(GROUPS))
def test_features_serve_internvl_within_their_tolerance(group):
    assert_group_serves(INTERNVL, *GROUPS[group], FEATURES[group])
