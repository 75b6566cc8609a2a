"""The trainer: a client of Megatron-LM's training engine, megatron.training.pretrain(), like pretrain_gpt.py and
MindSpeed-MM's pretrain_vlm.py: the model family's model provider, forward step and data sets (the registry's), with
the adaptor's features applied through the one-line import. Evaluation, logging, TensorBoard and W&B, signals, exit
conditions and checkpoints (asynchronous, fully parallel, resharding) are Megatron's.

    mm-adaptor train [Megatron-LM arguments] [--model ...] [feature flags] [--nproc-per-node N] [--nnodes ...]
    torchrun ... -m mm_adaptor.train [the same, without the launch flags]

The whole command line is checked before any rank starts (Megatron's own validation included): a problem is one
line and exit status 2. The check runs in a process forked from the server the ranks fork from, which imports torch
and megatron-core once for both (this process imports neither: 10 s of CPU less per launch). Without torchrun the
local ranks start here (mm_adaptor.ranks); SIGTERM or SIGINT to this command is passed on to the ranks, which save a
checkpoint (with --save) and stop; it then exits 0."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from dataclasses import dataclass

from mm_adaptor.ranks.launcher import Nodes
from mm_adaptor.train.arguments import PROG, UsageError

__all__ = ["main", "check", "UsageError"]


def _fail(problems) -> int:
    for line in problems:
        print(f"{PROG}: error: {' '.join(str(line).split())}", file=sys.stderr)
    return 2


def check(argv: list[str], *, under_torchrun: bool):
    """Parse, prepare and validate the command line as the ranks will (Megatron's parser and validation, the
    features', the family's, the data's), quietly: library notices of the imports are the ranks' to report (they
    replay them); under torchrun this process is a rank, and reports them. Returns (args, what the ranks are
    handed); raises UsageError. A bad flag or value exits 2 from the parser (one line)."""
    with contextlib.nullcontext() if under_torchrun else _library_notices_silenced():
        return _check(argv, under_torchrun)


@contextlib.contextmanager
def _library_notices_silenced():
    import logging
    import warnings

    from mm_adaptor.ranks.warning_digest import TORCH_CPP_EXTENSION_LOGGER

    loggers = [logging.getLogger(), logging.getLogger(TORCH_CPP_EXTENSION_LOGGER)]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def _check(argv: list[str], under_torchrun: bool):
    from megatron.training import arguments as megatron_arguments

    from mm_adaptor.core import features
    from mm_adaptor.train import arguments, families, megatron_training

    parse = getattr(megatron_arguments.parse_args, "__wrapped__", megatron_arguments.parse_args)
    with megatron_training.command_line(PROG, argv):
        args = arguments.prepare(parse(arguments.add_arguments))
    problems = arguments.launch_problems(args, under_torchrun)
    if problems:
        raise UsageError(*problems)
    args.world_size = arguments.environment_world_size() if under_torchrun else \
        arguments.local_ranks(args) * args.nnodes
    args.rank = 0
    options = features.fill_defaults(args)
    # as under the one-line import: a feature that is Megatron's arguments with other values (--moe-tp-extend-ep)
    # sets them before Megatron validates and fills in its defaults
    features.express_in_megatron_arguments(options, features.serving(options, features.enabled_features(options)))
    _megatron_validation(args)
    try:
        features.validate(options, features.serving(options, features.enabled_features(options)))
    except features.FeatureConfigError as exc:
        raise UsageError(*str(exc).splitlines()) from None
    family = families.of(args)
    problems = family.trainer_problems(args) + arguments.path_problems(args) + arguments.resume_problems(args)
    if problems:
        raise UsageError(*problems)
    problems = family.data_problems(args)
    problems = problems or arguments.data_resume_problems(args)
    if problems:
        raise UsageError(*problems)
    handoff = {"validated_data": args.validated_data} if getattr(args, "validated_data", None) else {}
    handoff["data_position"] = (args.data_fingerprint, args.data_first_sample)
    return args, handoff


@dataclass(frozen=True)
class LaunchPlan:
    """What the launcher needs of the checked command line; the ranks' handoff pickled, as its classes import
    torch."""
    nodes: Nodes
    nproc: int
    timeout: float
    save: str | None
    handoff: bytes


def launch_plan(argv: list[str]) -> LaunchPlan:
    """check() for a launcher (run where torch and megatron-core are imported: call_in_rank_server)."""
    import pickle

    from mm_adaptor.train import arguments

    args, handoff = check(argv, under_torchrun=False)
    nodes = Nodes(count=args.nnodes, rank=args.node_rank, addr=args.master_addr or "127.0.0.1",
                  port=args.master_port)
    return LaunchPlan(nodes, arguments.local_ranks(args), args.distributed_timeout_minutes * 60 + 300, args.save,
                      pickle.dumps(handoff))


def _megatron_validation(args) -> None:
    """Megatron's validate_args (not the adaptor's hook around it: nothing is applied here), its printout
    swallowed; an assertion it fails is one line, its message or its source line."""
    import traceback

    from megatron.training import arguments as megatron_arguments

    from mm_adaptor.core.errors import ConfigurationError
    from mm_adaptor.megatron_lm import _validate_with_overrides, refuse_known_megatron_bugs

    validate = getattr(megatron_arguments.validate_args, "__wrapped__", megatron_arguments.validate_args)
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet), _device_layer():
            # as the one-line import validates: the enabled features' overrides in place meanwhile (e.g.
            # --use-fused-gmm serving --moe-grouped-gemm, which Megatron refuses without a capable GPU)
            _validate_with_overrides(validate, (args, {}), {}, args)
    except (AssertionError, ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
        message = " ".join(str(exc).split())
        if not message:  # a bare assert: the line that failed
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            message = f"{frame.line} ({os.path.basename(frame.filename)}:{frame.lineno})"
        raise UsageError(f"Megatron-LM refuses the arguments: {message}") from None
    try:
        refuse_known_megatron_bugs(args)
    except ConfigurationError as exc:
        raise UsageError(str(exc)) from None


@contextlib.contextmanager
def _device_layer():
    """The run's device backend meanwhile (Megatron's validation asks the device, e.g. its architecture), unless
    one is installed already."""
    from mm_adaptor import devices

    if devices.current() is not None:
        yield
        return
    devices.install()
    try:
        yield
    finally:
        devices.uninstall()


def main(argv=None) -> int:
    from mm_adaptor.ranks.launcher import Interrupted, LaunchError, launch, under_launcher
    from mm_adaptor.train import megatron_training

    argv = list(sys.argv[1:] if argv is None else argv)
    missing = megatron_training.missing()
    if missing:
        return _fail([missing])
    if "-h" in argv or "--help" in argv:
        return _print_help()
    torchrun = under_launcher()
    if "--verbose" in argv:  # what parsing sets, before the imports it follows (the parse may run elsewhere)
        from mm_adaptor.ranks.warning_digest import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"
    if torchrun:  # this process is the rank: it reports its imports' notices itself, once across the ranks
        from mm_adaptor.ranks.warning_digest import print_every_ranks_warnings_once

        print_every_ranks_warnings_once(int(os.environ["RANK"]))
    else:
        from mm_adaptor.ranks.process import start_rank_server

        start_rank_server()
    try:
        if torchrun:
            args, handoff = check(argv, under_torchrun=True)
        else:
            from mm_adaptor.ranks.process import call_in_rank_server

            plan = call_in_rank_server(launch_plan, argv)
    except UsageError as exc:
        return _fail(exc.problems)
    from mm_adaptor.train import engine

    if torchrun:
        engine.run_rank(argv, handoff)
        return 0
    try:
        stopped = launch(engine.run_rank, (argv, plan.handoff), nproc=plan.nproc, timeout=plan.timeout,
                         nodes=plan.nodes, graceful=True)
    except Interrupted as exc:
        print(f"{PROG}: {exc}{_last_checkpoint(plan.save)}", file=sys.stderr)
        return exc.exit_status
    except LaunchError as exc:
        refused = getattr(exc, "summary", "")
        if refused.startswith(f"{UsageError.__name__}: "):  # what only the built model shows (a rank's UsageError)
            return _fail(refused[len(UsageError.__name__) + 2:].splitlines())
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    if stopped:
        import signal

        saved = f"; the checkpoint is in {plan.save}" if plan.save else " (no --save: nothing saved)"
        print(f"{PROG}: stopped on {signal.Signals(stopped).name}: the ranks finished their iteration{saved}",
              file=sys.stderr)
    return 0


def _last_checkpoint(save) -> str:
    """Where a resume starts: the save Megatron's tracker file names (a save cut short never moved it)."""
    if not save:
        return " (no --save: nothing saved)"
    from mm_adaptor.convert.mcore_io import MARKER

    tracker = os.path.join(save, MARKER)
    try:
        with open(tracker) as file:
            iteration = file.read().strip()
    except OSError:
        return f"; no checkpoint in {save} yet"
    return f"; last checkpoint: {os.path.join(save, f'iter_{int(iteration):07d}') if iteration.isdigit() else save}"


def _print_help() -> int:
    from mm_adaptor.train import arguments, megatron_training

    with megatron_training.command_line(PROG, ["--help"]):
        from megatron.training import arguments as megatron_arguments

        parse = getattr(megatron_arguments.parse_args, "__wrapped__", megatron_arguments.parse_args)
        try:
            parse(arguments.add_arguments)
        except SystemExit as exc:
            return exc.code or 0
    return 0
