"""--hybrid-layer-pattern on the installed megatron-core (0.18 or newer: HybridModel): mm_adaptor builds the pattern's
layers ('*' attention, '-' MLP, 'E' MoE, '|' pipeline segments) from megatron's local spec and trains them; every
feature serving here passes check against unpatched Megatron on a HybridModel, grouped into few runs as
test_features_on_latest_megatron.py groups them on the GPT, with each feature's mechanism seen at work on the
hybrid layers (its wrappers called; swap-attention's host bytes and recompute-activation-function's freed bytes per
layer kind; the extended schedules); patterns it cannot build are refused in one line."""

import math

import pytest
from feature_runs import assert_run_passes

from mm_adaptor.core import features

from mm_adaptor.versions import serving
from mm_adaptor.harness import composition
from mm_adaptor.train import hybrid
from mm_adaptor.harness.runner.arguments import LayoutError, finalize_args, parse_args

BUILT_IN = sorted(features.built_in_features(), key=lambda f: f.name)
REFUSALS = serving.refusals_here()
# The optimizer-state features act on the optimizer, not on layers: tests/latest/test_optimizer_features_on_latest.py
# (reuse) and tests/distributed/test_optimizer_state_features.py (swap, virtual) check them on this release
OPTIMIZER_STATE = {"reuse-fp32-param", "swap-optimizer", "virtual-optimizer"}
SERVING = [f for f in BUILT_IN if not REFUSALS[f.name] and f.name not in OPTIMIZER_STATE]


def pattern_for(parallel: frozenset) -> str:
    """Two GPT layers' worth ('*-' each; '*E' with experts), as four pipeline segments under a virtual pipeline."""
    unit = hybrid.ATTENTION + (hybrid.MOE if "moe" in parallel else hybrid.MLP)
    return "|".join([unit] * 4) if "vpp" in parallel else unit * 2


class HybridRun(composition.Run):
    """A composition run on a HybridModel: the same parallel sizes, the layers from a pattern (and its segments)
    instead of --num-layers and --num-layers-per-virtual-pipeline-stage."""

    @property
    def pattern(self) -> str:
        return pattern_for(self.parallel)

    def base_args(self) -> list[str]:
        layout, _ = composition.layout_args(self.parallel, self.experts_over_tp)
        kept, skip = [], False
        for token in layout:
            if skip:
                skip = False
            elif token in ("--num-layers", "--num-layers-per-virtual-pipeline-stage"):
                skip = True
            else:
                kept.append(token)
        switches = dict.fromkeys(a for f in self.members for a in composition.needs_of(f).base_args)
        return [*kept, f"{hybrid.FLAG}={self.pattern}", *composition.MODEL_ARGS, *switches]


def runs() -> list[HybridRun]:
    """Two ranks each (four where a virtual pipeline meets EP2): the exact serving features in one run (a virtual
    pipeline if one needs it), the inexact ones that need no experts in one TP2+SP run (one refused beside them in a
    run of its own), and on MoE layers ('*E*E', EP2) those that need experts with the exact ones that act per layer
    again (again, one refused beside them alone)."""
    needs = {f.name: composition.needs_of(f).parallel for f in SERVING}
    exact = tuple(f for f in SERVING if f.tolerance.exact)
    dense = tuple(f for f in SERVING if not f.tolerance.exact and "moe" not in needs[f.name])
    moe = tuple(f for f in SERVING if (f.tolerance.exact and needs[f.name] <= {"moe"})
                or (not f.tolerance.exact and "moe" in needs[f.name]))
    groups = []
    if exact:  # one refused beside the others (--moe-alltoall-overlap-comm beside --moe-zero-memory) runs alone
        together, alone = [], []
        for feature in exact:
            parallel = frozenset().union(*(needs[f.name] for f in (*together, feature)))
            (together if composition.refusal((*together, feature), parallel) is None else alone).append(feature)
        groups.append(HybridRun(tuple(together), frozenset().union(*(needs[f.name] for f in together))))
        groups += [HybridRun((feature,), needs[feature.name]) for feature in alone]
    # a feature refused beside the others runs alone; context parallelism (TP2 x CP2: 4 ranks) is tried last, so
    # that it is the one refused beside flash attention and runs alone on 2 ranks
    together, alone = [], []
    for feature in sorted(dense, key=lambda f: composition.layout_args(frozenset({"tp"}) | needs[f.name])[1]):
        parallel = frozenset({"tp"}).union(*(needs[f.name] for f in (*together, feature)))
        (together if composition.refusal((*together, feature), parallel) is None else alone).append(feature)
    if together:
        groups.append(HybridRun(tuple(together), frozenset({"tp"}).union(*(needs[f.name] for f in together))))
    groups += [HybridRun((feature,), needs[feature.name]) for feature in alone]
    if moe:  # a feature refused beside the others (--moe-zero-memory level1 beside grouped GEMMs) runs alone
        together, alone = [], []
        for feature in moe:
            parallel = frozenset({"moe"}).union(*(needs[f.name] for f in (*together, feature)))
            (together if composition.refusal((*together, feature), parallel) is None else alone).append(feature)
        groups.append(HybridRun(tuple(together), frozenset({"moe"}).union(*(needs[f.name] for f in together))))
        on_moe_layers = {f.name for run in groups if "moe" in run.parallel for f in run.members}
        groups += [HybridRun((feature,), frozenset({"moe"}) | needs[feature.name]) for feature in alone
                   if feature.name not in on_moe_layers]  # an exact one that ran on MoE layers already
    return groups


def rank0_kinds(pattern: str, pp: int) -> dict[str, str]:
    """{"layer N": symbol} of the layers pipeline rank 0 holds (megatron's segment choice)."""
    segments = hybrid.segments(pattern)
    flat = pattern.replace(hybrid.PIPE, "")
    if len(segments) == 1:
        held = range(len(flat) // pp)
    else:
        starts = [sum(len(s) for s in segments[:i]) for i in range(len(segments))]
        held = [starts[i] + j for i in range(0, len(segments), pp) for j in range(len(segments[i]))]
    return {f"layer {n + 1}": flat[n] for n in held}


def rank0_chunk_ends(pattern: str, pp: int) -> set[str]:
    """The last layer of each model chunk pipeline rank 0 holds (swap attention never swaps it)."""
    segments = hybrid.segments(pattern)
    if len(segments) == 1:
        return {f"layer {len(pattern.replace(hybrid.PIPE, '')) // pp}"}
    starts = [sum(len(s) for s in segments[:i]) for i in range(len(segments))]
    return {f"layer {starts[i] + len(segments[i])}" for i in range(0, len(segments), pp)}


def test_every_serving_feature_is_in_a_hybrid_run():
    assert SERVING, "no feature serves here"
    covered = {f.name for run in runs() for f in run.members}
    assert covered == {f.name for f in SERVING}


@pytest.mark.distributed
@pytest.mark.parametrize("run", runs(), ids=lambda r: f"{r.pattern}:" + ",".join(f.name for f in r.members))
def test_serving_features_pass_check_on_a_hybrid_model(run):
    names = {f.name for f in run.members}
    result = assert_run_passes(run)
    on, off = result.memory_on, result.memory_off
    # the pattern was built: rank 0's layers, read back from the modules, are its share of the pattern
    pp = 2 if "vpp" in run.parallel else 1
    assert on["hybrid_layer_kinds"] == rank0_kinds(run.pattern, pp)
    assert all(math.isfinite(loss) for loss in result.losses_on)
    assert result.losses_on[-1] < result.losses_on[0], result.losses_on
    kinds, saved = on["hybrid_layer_kinds"], on["saved_bytes_per_layer"]
    host = on.get("host_saved_bytes_per_layer", {})
    layers = [label for label in saved if label.startswith("layer")]
    assert {kinds[label] for label in layers} >= {hybrid.ATTENTION}, layers
    if "swap-attention" in names:  # it reached the hybrid layers but the last of each chunk, which it keeps
        ends = rank0_chunk_ends(run.pattern, pp)
        assert all((host.get(label, 0) > 0) == (label not in ends) for label in layers), (host, ends)
    if "recompute-activation-function" in names:
        for label in layers:
            freed = off["saved_bytes_per_layer"][label] - saved[label] - host.get(label, 0)
            if kinds[label] == hybrid.ATTENTION:
                assert freed == 0, (label, freed)  # no MLP there: nothing recomputed
            else:
                assert freed > 0, (label, freed)  # the activation's output is no longer kept
    if "vpp-extra-warmup" in names:
        assert on["feature_statistics"]["vpp-extra-warmup"]["schedules extended"] > 0
    if "moe-zero-memory" in names:  # the 'E' layers' experts released their input and dispatched it again
        assert on["feature_statistics"]["moe-zero-memory"]["experts' inputs dispatched again"] > 0


def hybrid_args(*argv: str, nproc: int = 2):
    return parse_args([*argv, "--nproc-per-node", str(nproc)])


@pytest.mark.parametrize("argv, words", [
    (["--hybrid-layer-pattern=*-|*-|*-", "--pipeline-model-parallel-size", "2"], "3 pipeline segments"),
    (["--hybrid-layer-pattern=*-|*-"], "--pipeline-model-parallel-size is 1"),
    (["--hybrid-layer-pattern=*-*", "--pipeline-model-parallel-size", "2"], "3 layers"),
    (["--hybrid-layer-pattern=*-|*-|*-|*-", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "1"], "mark the virtual pipeline stages with '|'"),
    (["--hybrid-layer-pattern=*E"], "need --num-experts"),
    (["--hybrid-layer-pattern=*-", "--num-experts", "2"], "has none"),
    (["--hybrid-layer-pattern=*-/*-"], "multi-token prediction"),
    (["--hybrid-layer-pattern=*x"], "'x' is not a layer symbol"),
    (["--hybrid-layer-pattern=*-||*-", "--pipeline-model-parallel-size", "2"], "empty pipeline segment"),
    (["--hybrid-layer-pattern=D-"], "DeepSeek sparse attention"),
])
def test_what_mm_adaptor_cannot_build_is_one_line_naming_it(argv, words):
    with pytest.raises(LayoutError) as refused:
        finalize_args(hybrid_args(*argv), 2)
    assert len(refused.value.problems) == 1 and words in str(refused.value), str(refused.value)


def test_the_pattern_sets_the_layers_and_the_virtual_pipeline():
    args = finalize_args(hybrid_args("--hybrid-layer-pattern=*-|*E-|*-|*-", "--pipeline-model-parallel-size", "2",
                                     "--num-experts", "2", "--global-batch-size", "8", "--num-layers", "2"), 2)
    assert (args.num_layers, args.virtual_pipeline_model_parallel_size) == (9, 2)


@pytest.mark.parametrize("pattern, package", [("M*M-", "mamba-ssm"), ("G-*-", "flash-linear-attention")])
def test_mamba_and_gated_delta_net_refuse_in_one_line_naming_the_package(pattern, package):
    if hybrid._has_package(hybrid.NEEDS_PACKAGE[pattern[0]][0]):
        pytest.skip(f"{package} is installed here")
    from trainer_runs import train  # `mm-adaptor train` in this process: no second start of torch and megatron

    done = train([f"--hybrid-layer-pattern={pattern}"])
    lines = [line for line in done.err.splitlines() if line.startswith("mm-adaptor train: error:")]
    assert done.status == 2 and len(lines) == 1, done.err
    assert package in lines[0] and "not installed" in lines[0], lines[0]


@pytest.mark.distributed
def test_a_swap_that_brings_back_another_layers_tensors_fails_on_a_hybrid_model(monkeypatch):
    """The broken swap-attention variant reaches the HybridStack's layers too (through the same wraps), so its
    wrong prefetch must fail there; the unpatched run is the exact group's (cached)."""
    from pathlib import Path

    from mm_adaptor import harness

    if "swap-attention" not in {f.name for f in SERVING}:
        pytest.skip("swap-attention does not serve here")
    exact = next(run for run in runs() if run.exact)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "distributed"))
    with harness.extra_feature_module("broken_swap_attention_feature"):
        result = harness.compare(["--use-test-swap-attention-other-layer"], extra_args=exact.base_args(),
                                 nproc=exact.nproc, iters=3)
    assert not result.passed
    assert result.grads.failures, "the wrong tensors reach the gradients"


@pytest.mark.distributed
def test_a_recompute_from_a_perturbed_input_fails_on_a_hybrid_model(monkeypatch):
    """The broken recompute variant marks the HybridStack's MLP layers as the real feature does, so its recomputation
    from an input one ulp off must reach the gradients there; the unpatched run is the exact group's (cached)."""
    from pathlib import Path

    from mm_adaptor import harness

    exact = next(run for run in runs() if run.exact)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "distributed"))
    with harness.extra_feature_module("broken_recompute_activation_feature"):
        result = harness.compare(["--use-test-recompute-activation-perturbed"], extra_args=exact.base_args(),
                                 nproc=exact.nproc, iters=3)
    assert not result.passed
    assert result.grads.failures, "the wrong recomputation reaches the gradients"
