"""--use-coc on the newest megatron-core (collected only on 0.17 or newer): it serves, the linears' and the MoE
layer's functions being core_v0.19.0's. Its regression tests (tests/distributed/test_coc.py: bit for bit in TP2 with
and without sequence parallelism, EP2 x expert TP2 MoE within tolerance, the chunked paths counted as run, the
broken variant failing) run on this release with the whole suite."""

from mm_adaptor.versions import serving
def test_coc_serves_on_this_release():
    state = {s.name: s for s in serving.feature_states()}["coc"]
    assert not state.refusals, state.refusals
