"""mm_adaptor.versions.known_bugs: which layouts are refused on which megatron-core, and each way in refuses them
(check's launcher, the one-line import after Megatron-LM's validation); tests/distributed/test_known_megatron_bugs.py
shows on the installed release that unpatched megatron does train them wrongly."""

import argparse

import pytest

from mm_adaptor.core.errors import ConfigurationError
from mm_adaptor.harness import composition, runner
from mm_adaptor.megatron_lm import refuse_known_megatron_bugs
from mm_adaptor.versions import contracts, known_bugs


@pytest.mark.parametrize("tp, ep, etp, version, refused", [
    (2, 1, 1, "0.16.1", True),
    (1, 1, 2, "0.16.1", True),  # expert TP above TP: the same dense-group reduction
    (2, 1, 1, "0.18.0rc1", True),
    (2, 1, 1, "0.19.0", False),
    (2, 1, 1, "0.19.2", False),
    (2, 2, 1, "0.16.1", False),  # expert parallelism: megatron uses the expert groups
    (2, 1, 2, "0.16.1", False),
    (2, 1, None, "0.16.1", False),  # megatron's default: expert TP = TP
])
def test_refused_on_the_releases_without_the_fix(tp, ep, etp, version, refused):
    problem = known_bugs.expert_gradient_problem(tp, ep, etp, version)
    assert bool(problem) == refused, problem
    if refused:
        assert problem.startswith(f"megatron-core {version} ") and "#5916" in problem and "\n" not in problem


def installed(monkeypatch, version):
    monkeypatch.setattr(contracts, "installed_version", lambda package=contracts.MEGATRON_CORE: version)


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_check_and_the_one_line_import_refuse_it_before_any_rank_starts(monkeypatch, version):
    installed(monkeypatch, version)
    args = runner.parse_args(["--num-layers", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--num-experts", "4", "--disable-bias-linear", "--expert-tensor-parallel-size", "1",
                              "--nproc-per-node", "2"])
    megatron_args = argparse.Namespace(num_experts=4, tensor_model_parallel_size=2, expert_model_parallel_size=1,
                                       expert_tensor_parallel_size=1)
    if version == "0.16.1":
        with pytest.raises(runner.LayoutError, match="#5916"):
            runner.check_args(args, 2, check_devices=False)
        with pytest.raises(ConfigurationError, match="#5916"):
            refuse_known_megatron_bugs(megatron_args)
    else:
        runner.check_args(args, 2, check_devices=False)
        refuse_known_megatron_bugs(megatron_args)
    refuse_known_megatron_bugs(argparse.Namespace(num_experts=None, tensor_model_parallel_size=2))  # dense models


def test_the_pair_layouts_keep_a_given_ep_of_2_where_ep_1_would_be_refused(monkeypatch):
    """--moe-tp-extend-ep's runs beside balanced's expert TP 1: their unpatched baseline at EP 1 is refused below
    0.19, so the layout keeps the given EP 2 there."""
    for version, ep in (("0.16.1", "2"), ("0.19.2", None)):
        installed(monkeypatch, version)
        args, _ = composition.layout_args(frozenset({"tp", "moe"}), experts_over_tp=True)
        given = args[args.index("--expert-model-parallel-size") + 1] if "--expert-model-parallel-size" in args else None
        assert given == ep, (version, args)
