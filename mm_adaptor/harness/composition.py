"""Feature pairs as a tested property: every pair of registered features either trains together and passes check
against unpatched Megatron, or is refused in one line, before any rank starts, naming both flags.

Each feature says what it needs to do anything (NEEDS: a parallel dimension, model or precision switches, its own
tuning flags); a pair runs in the smallest layout that serves both. Accepted pairs are covered by groups: several
features switched on together in one run, so that the matrix costs a few runs instead of one per pair. A group holds
only features that were accepted pairwise and that validate together; a group of exact features is judged
bit-for-bit, a group with an inexact feature by the calibrated tolerance (the loosest member's, as check does).
`pair_plan(each_pair=True)` gives one run per pair instead (slower; benchmarks/RESULTS.md has such a run)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from mm_adaptor.core import features
from mm_adaptor.harness.compare import HarnessError, checked_args
from mm_adaptor.versions import known_bugs

# Every run: a model on which each layer feature has something to do (norms, SwiGLU, rotary embeddings).
MODEL_ARGS = ("--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope")


@dataclass(frozen=True)
class Needs:
    parallel: frozenset = frozenset()  # of "tp", "vpp", "moe", "distopt", "cp"
    base_args: tuple[str, ...] = ()  # switches of the model or precision, in both runs
    feature_args: tuple[str, ...] = ()  # the feature's own tuning flags, in the run with it only
    experts_over_tp: bool = False  # megatron's EP becomes TP x the given EP: the given EP stays 1


NEEDS: dict[str, Needs] = {
    # expert TP 1: the matrix's layouts put TP2 beside the experts, and expert TP follows TP by default
    "balanced-moe-experts": Needs(frozenset({"moe"}), ("--expert-tensor-parallel-size", "1"),
                                  feature_args=("--balanced-moe-hot-expert-num", "1")),
    "coc": Needs(frozenset({"tp"})),
    # its main flag takes the size; the ring, on the smallest CP group
    "context-parallel": Needs(frozenset({"cp"}), feature_args=("2", "--context-parallel-algo", "megatron_cp_algo")),
    "fused-gmm": Needs(frozenset({"moe"}), ("--moe-grouped-gemm", "--disable-bias-linear")),
    "moe-alltoall-overlap-comm": Needs(frozenset({"moe"}), ("--moe-token-dispatcher-type", "alltoall",
                                                           "--disable-bias-linear")),
    # beside TP (coc's) experts are TP-split, which megatron serves without biases only
    "moe-permutation-async-comm": Needs(frozenset({"moe"}), ("--disable-bias-linear",)),
    "moe-tp-extend-ep": Needs(frozenset({"tp", "moe"}), ("--disable-bias-linear",),  # it refuses TP 1
                              experts_over_tp=True),
    "moe-zero-memory": Needs(frozenset({"moe"}), ("--disable-bias-linear",), feature_args=("level0",)),
    "reuse-fp32-param": Needs(base_args=("--bf16",)),
    "swap-attention": Needs(feature_args=("--swap-min-bytes", "0")),  # the tiny model's tensors are all small
    "swap-optimizer": Needs(frozenset({"distopt"})),
    "vpp-extra-warmup": Needs(frozenset({"vpp"})),
}


def needs_of(feature: features.Feature) -> Needs:
    return NEEDS.get(feature.name, Needs())


def layout_args(parallel: frozenset, experts_over_tp: bool = False) -> tuple[list[str], int]:
    """The training arguments of the smallest layout with these dimensions, and its rank count. `experts_over_tp`:
    the TP ranks already hold different experts (megatron's EP is TP x the given EP), so the given EP is 1."""
    tp, pp = (2 if "tp" in parallel else 1), (2 if "vpp" in parallel else 1)
    # (the given EP stays 2 where unpatched megatron would train the baseline's experts wrongly at EP 1 with expert
    # TP 1, what balanced's runs need: megatron-core < 0.19, known_bugs)
    given_ep_1 = experts_over_tp and tp > 1 and known_bugs.expert_gradient_problem(tp, 1, 1) is None
    ep = 2 if "moe" in parallel and not given_ep_1 else 1
    cp = 2 if "cp" in parallel else 1  # the feature's own flags set it (NEEDS); the layout counts its ranks
    # experts span TP x CP x DP ranks (expert TP = TP), so CP x DP is a multiple of EP; otherwise DP2 where nothing
    # else is 2
    dp = max(1, ep // cp) if ep > 1 else (2 if tp == pp == cp == 1 else 1)
    args = ["--num-layers", "4" if pp > 1 else "2"]
    if tp > 1:
        args += ["--tensor-model-parallel-size", str(tp), "--sequence-parallel"]
    if pp > 1:
        args += ["--pipeline-model-parallel-size", str(pp), "--num-layers-per-virtual-pipeline-stage", "1",
                 "--global-batch-size", str(8 * dp)]
    if ep > 1:
        args += ["--num-experts", "4", "--expert-model-parallel-size", str(ep)]
    elif "moe" in parallel:
        args += ["--num-experts", "4"]
    if "distopt" in parallel:
        args += ["--use-distributed-optimizer"]
    return args, tp * pp * cp * dp


@dataclass
class Run:
    """Features switched on together in one layout: the pairs among them are what the run covers."""

    members: tuple[features.Feature, ...]
    parallel: frozenset
    pairs: list[tuple[str, str]] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return all(f.tolerance.exact for f in self.members)

    @property
    def experts_over_tp(self) -> bool:
        return any(needs_of(f).experts_over_tp for f in self.members)

    def base_args(self) -> list[str]:
        layout, _ = layout_args(self.parallel, self.experts_over_tp)
        switches = dict.fromkeys(a for f in self.members for a in needs_of(f).base_args)
        return [*layout, *MODEL_ARGS, *switches]

    def feature_args(self) -> list[str]:
        return [a for f in self.members for a in (f.main_flag.option, *needs_of(f).feature_args)]

    @property
    def nproc(self) -> int:
        return layout_args(self.parallel, self.experts_over_tp)[1]

    def describe(self) -> str:
        return f"{' '.join(self.feature_args())} | {' '.join(self.base_args())} | {self.nproc} ranks"


def refusal(members, parallel: frozenset) -> str | None:
    """The one-line refusal of these features together in this layout, or None when they validate."""
    run = Run(tuple(members), parallel)
    argv = [*run.base_args(), *run.feature_args(), "--nproc-per-node", str(run.nproc)]
    try:
        checked_args(argv, check_devices=False)
    except HarnessError as exc:
        return str(exc)
    return None


@dataclass
class PairPlan:
    refused: dict[tuple[str, str], str]  # pair -> its refusal
    runs: list[Run]

    def covered(self) -> set[tuple[str, str]]:
        return {pair for run in self.runs for pair in run.pairs}


def _pair(a: features.Feature, b: features.Feature) -> tuple[str, str]:
    return tuple(sorted((a.name, b.name)))


def pair_plan(candidates: list[features.Feature] | None = None, *, each_pair: bool = False) -> PairPlan:
    """Validate every pair in its layout, then cover the accepted pairs with runs (greedily, largest layouts
    first, so that features with no needs join the runs that exist anyway)."""
    feats = sorted(candidates if candidates is not None else features.all_features(), key=lambda f: f.name)
    refused, accepted = {}, {}
    for a, b in itertools.combinations(feats, 2):
        parallel = needs_of(a).parallel | needs_of(b).parallel
        reason = refusal((a, b), parallel)
        if reason is None:
            accepted[_pair(a, b)] = parallel
        else:
            refused[_pair(a, b)] = reason
    by_name = {f.name: f for f in feats}
    if each_pair:
        runs = [Run((by_name[a], by_name[b]), parallel, [(a, b)]) for (a, b), parallel in accepted.items()]
        return PairPlan(refused, runs)
    runs, uncovered = [], dict(accepted)
    while uncovered:
        # exact pairs first (their runs stay bit-for-bit), then the pair with the most needs
        (a, b), parallel = max(uncovered.items(), key=lambda item: (
            all(by_name[n].tolerance.exact for n in item[0]), len(item[1]), tuple(item[0])))
        members = [by_name[a], by_name[b]]
        exact = all(f.tolerance.exact for f in members)
        for other in feats:
            if other in members or not needs_of(other).parallel <= parallel or (exact and not other.tolerance.exact):
                continue
            if all(_pair(other, m) in accepted for m in members) and refusal((*members, other), parallel) is None:
                members.append(other)
        run = Run(tuple(members), parallel)
        run.pairs = sorted(_pair(x, y) for x, y in itertools.combinations(members, 2) if _pair(x, y) in accepted)
        for pair in run.pairs:
            uncovered.pop(pair, None)
        runs.append(run)
    return PairPlan(refused, runs)
