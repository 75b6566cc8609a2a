"""The check harness's runner: its instrument, not a trainer (users train with mm_adaptor.train, on Megatron-LM's
loop). It trains the same model in fresh local ranks with and without features under identical conditions and
records what the verdicts compare: every step's losses and main gradients, the parameters, the module outputs and
the memory figures (dump.py).

    run(parse_args([...]))  # -> Dump of what every rank recorded
"""

from __future__ import annotations

import argparse
import os
import tempfile

from mm_adaptor.core import features
from mm_adaptor.ranks.launcher import launch, under_launcher
from mm_adaptor.train import families
from mm_adaptor.versions import known_bugs
from mm_adaptor.harness.runner.arguments import LayoutError, build_parser, check_paths, finalize_args, parse_args
from mm_adaptor.harness.runner.dump import Dump, RankDump, dump_entries, read_dump
from mm_adaptor.harness.runner.loop import run_rank

__all__ = ["run", "parse_args", "build_parser", "finalize_args", "LayoutError", "Dump", "RankDump",
           "dump_entries", "check_args"]


def check_args(args: argparse.Namespace, world_size: int, *, check_devices: bool = True) -> None:
    """Raise LayoutError (one line per problem) or FeatureConfigError before any rank starts: ranges and layout,
    then the features, then the directories (only then is --save created and probed)."""
    # the installed megatron's known bugs in the launcher only: a rank's own finalize_args leaves them out
    problem = known_bugs.layout_problem(finalize_args(argparse.Namespace(**vars(args)), world_size))
    if problem:
        raise LayoutError(problem)
    families.of(args).shape_args(args)  # the features check the model's shape (RMSNorm, SwiGLU, rope)
    options = features.fill_defaults(args)
    features.validate(options, features.serving(options, features.enabled_features(options)))
    check_paths(args)
    _check_data(args)
    problem = check_devices and _ranks_per_node_problem(args)  # last: it imports torch
    if problem:
        raise LayoutError(problem)


def _check_data(args: argparse.Namespace) -> None:
    """A VLM's data set is validated here, once, before any rank starts (its DataError is one line)."""
    problems = families.of(args).data_problems(args)
    if problems:
        raise LayoutError(*problems)


def _ranks_per_node_problem(args: argparse.Namespace) -> str | None:
    from mm_adaptor import devices  # imports torch

    backend = devices.current_or_chosen()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if under_launcher() else args.nproc_per_node
    return backend.ranks_per_node_problem(ranks)


def run(args: argparse.Namespace, *, echo: bool = False) -> Dump:
    """Train with `args` (from parse_args) in fresh local ranks and return what every rank recorded.

    Raises LayoutError / FeatureConfigError before starting, LaunchError when a rank fails or hangs."""
    args = argparse.Namespace(**vars(args))
    check_args(args, args.nproc_per_node)
    with tempfile.TemporaryDirectory(prefix="mm-adaptor-run-") as tmp:
        args.dump, args.silent, args.quiet = tmp, not echo, echo
        launch(run_rank, (args,), nproc=args.nproc_per_node, timeout=args.timeout)
        return read_dump(tmp, args.nproc_per_node)
