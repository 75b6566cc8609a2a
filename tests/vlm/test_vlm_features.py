"""`mm-adaptor check --model qwen2_5_vl-tiny --FEATURE`: the features serve the VLM within their declared tolerance
against unpatched Megatron, batched into three comparisons (TP2 with sequence parallelism, 2 language layers);
each member's wrappers must have run. VPP (--vpp-extra-warmup) is refused by the model in one line."""

import pytest

from mm_adaptor import harness
from mm_adaptor.harness.compare import HarnessError, checked_args

pytestmark = pytest.mark.distributed

# micro-batch 1: the mrope frequencies are [s, 1, 1, rot], which the fused rotary kernel takes (per-sample ones fall
# back to megatron's code)
VLM = ["--model", "qwen2_5_vl-tiny", "--micro-batch-size", "1"]
GROUPS = {  # name: (feature flags, flags of both runs, exact)
    "kernels": (["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn",
                 "--use-coc"], [], False),
    "memory": (["--recompute-activation-function", "--swap-attention", "--swap-min-bytes", "0", "--swap-optimizer"],
               ["--use-distributed-optimizer"], True),
    "bf16-optimizer": (["--reuse-fp32-param", "--virtual-optimizer"], ["--bf16", "--use-distributed-optimizer"], True),
}
FEATURES = {"kernels": ["fused-rmsnorm", "fused-swiglu", "fused-rotary-pos-emb", "flash-attn", "coc"],
            "memory": ["recompute-activation-function", "swap-attention", "swap-optimizer"],
            "bf16-optimizer": ["reuse-fp32-param", "virtual-optimizer"]}


def _ran(calls: dict) -> bool:
    counted = [n for n in calls.values() if n is not None]
    return sum(counted) > 0 if counted else True  # replacements only: applied is all there is to see


@pytest.mark.parametrize("group", list(GROUPS))
def test_features_serve_the_vlm_within_their_tolerance(group):
    flags, base, exact = GROUPS[group]
    result = harness.compare(flags, layout="tp2-sp", extra_args=[*VLM, *base], iters=3)
    assert result.passed, harness.format_comparison(result)
    assert result.tolerance.exact == exact
    calls = result.memory_on["patch_calls"]
    for name in FEATURES[group]:
        assert name in calls, f"{name} was not applied"
        assert _ran(calls[name]), f"{name}'s wrappers never ran: {calls[name]}"


def test_refused_features_give_one_line_reasons():
    argv = [*VLM, "--pipeline-model-parallel-size", "2", "--num-layers", "4",
            "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4", "--vpp-extra-warmup",
            "--nproc-per-node", "2"]
    with pytest.raises(HarnessError) as error:
        checked_args(argv, check_devices=False)
    lines = str(error.value).splitlines()
    assert lines == ["--model qwen2_5_vl-tiny: virtual pipeline stages are not supported (the vision encoder belongs "
                     "to the first virtual stage only, not built yet): drop --num-layers-per-virtual-pipeline-stage"]
