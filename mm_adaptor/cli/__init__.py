"""`mm-adaptor` command line: the commands, their dispatch, and the small ones (build-ops, fingerprint); report is
in cli_report, check and calibrate in cli_check, the others in their own packages.

Every command's parser prints an error as one line and exits with 2; torch and megatron are imported only by the
commands that need them, so `mm-adaptor --help` and argument errors are fast."""

from __future__ import annotations

import sys

from mm_adaptor.core.one_line_parser import ArgumentParser, did_you_mean
from mm_adaptor.cli.check import calibrate_main, check_main
from mm_adaptor.cli.report import report_main


def build_ops_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="mm-adaptor build-ops",
                            description="Build the native ops ahead of time into the shared cache.")
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    from mm_adaptor.ops import builder

    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    failed = False
    for device in devices:
        try:
            result = builder.build(device, verbose=args.verbose)
            print(f"{device}: {'built' if result.built_now else 'already built'} -> {result.library} "
                  f"({result.seconds:.1f} s)")
        except builder.BuildUnavailable as exc:
            print(f"{device}: not built: {exc}")
            failed = failed or args.device != "all"
    return 1 if failed else 0


def fingerprint_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="mm-adaptor fingerprint",
                            description="Print the contract fingerprint of each dotted target (module.attribute or "
                                        "module.Class.method), for patch authors.")
    parser.add_argument("targets", nargs="+", metavar="DOTTED.TARGET")
    args = parser.parse_args(argv)
    from mm_adaptor.core.patching import _MISSING, Patch, PatchError, fingerprint, resolve

    lines = []
    for target in args.targets:  # all resolved before anything is printed
        try:
            owner, name = resolve(target)
        except PatchError as exc:
            parser.fail(str(exc))
        except Exception as exc:  # the target's module raised while importing
            parser.fail(f"cannot resolve {target!r}: importing it raised {type(exc).__name__}: {exc}")
        original, _ = Patch._raw_attribute(owner, name)  # what a contract on this target fingerprints
        if original is _MISSING:
            parser.fail(f"cannot resolve {target!r}: {getattr(owner, '__name__', owner)} has no attribute {name!r}")
        lines.append(f"{target} {fingerprint(original)}")
    print("\n".join(lines))
    return 0


def _train_main(argv: list[str]) -> int:
    from mm_adaptor.train import main as train_main

    return train_main(argv)


def _schedule_main(argv: list[str]) -> int:
    from mm_adaptor.cli.schedule import main as schedule_main

    return schedule_main(argv)


def _convert_main(argv: list[str]) -> int:
    from mm_adaptor.convert.cli import main as convert_main

    return convert_main(argv)


def _data_main(argv: list[str]) -> int:
    from mm_adaptor.data.cli import main as data_main

    return data_main(argv)


COMMANDS = {
    "report": (report_main, "versions, device backend, native ops and every feature"),
    "train": (_train_main, "train on Megatron-LM's loop: the tiny GPT, a vision-language family, a checkpoint (see "
                           "mm-adaptor train --help)"),
    "check": (check_main, "features off vs on: losses, gradients, memory (see mm-adaptor check --help)"),
    "calibrate": (calibrate_main, "measure Megatron's rounding noise, which sets check's inexact thresholds"),
    "fingerprint": (fingerprint_main, "print the contract fingerprint of dotted targets (for patch authors)"),
    "build-ops": (build_ops_main, "build the native ops ahead of time"),
    "convert": (_convert_main, "convert checkpoints: hf-to-mcore, mcore-to-hf (see mm-adaptor convert --help)"),
    "data": (_data_main, "training data: llava-to-messages, make-shapes, check (see mm-adaptor data --help)"),
    "schedule": (_schedule_main, "simulate pipeline schedules: step time, bubble, memory, timeline picture"),
    "generate": (lambda argv: __import__("mm_adaptor.cli.generate", fromlist=["main"]).main(argv),
                 "greedy decoding with a Qwen2.5-VL checkpoint (see mm-adaptor generate --help)"),
}


def run(argv=None) -> None:
    """The program (`mm-adaptor`, `python -m mm_adaptor.cli`): main(), then exit without the interpreter's teardown,
    a garbage collection over torch's and megatron's modules that took 1.5 to 3.5 s after a trainer run's work.
    It collects less often meanwhile (core.imports)."""
    import gc

    from mm_adaptor.core.imports import LAUNCHER_GC_THRESHOLD
    from mm_adaptor.ranks.process import exit_skipping_teardown

    gc.set_threshold(LAUNCHER_GC_THRESHOLD, *gc.get_threshold()[1:])
    exit_skipping_teardown(main(argv))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(prog="mm-adaptor", description="Acceleration adaptor for Megatron-Core.",
                            help_hint="`mm-adaptor --help` lists the commands")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, (_run, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv:
        parser.print_help()
        return 2
    command, rest = argv[0], argv[1:]
    if command in COMMANDS:
        from mm_adaptor.ranks.launcher import Interrupted, report_interruptions
        from mm_adaptor.ranks.warning_digest import PRINTER, own_warnings_as_the_ranks

        report_interruptions()
        try:
            with own_warnings_as_the_ranks():
                status = COMMANDS[command][0](rest)
        except Interrupted as exc:  # the ranks are stopped; one line, no traceback
            print(f"mm-adaptor {command}: {exc}", file=sys.stderr)
            return exc.exit_status
        except KeyboardInterrupt:  # Ctrl-C while no rank ran
            print(f"mm-adaptor {command}: interrupted (SIGINT)", file=sys.stderr)
            return 130
        if status < 128 and status != 2:  # not after the one line of an interruption or a refusal
            PRINTER.close()  # the count of known-harmless warnings the ranks gave, in one line
        return status
    if command.startswith("-"):
        parser.parse_args(argv)  # --help, or a one-line error
    hint = did_you_mean(command, COMMANDS)
    parser.fail(f"unknown command {command}" + (f": {hint}" if hint else "") + parser.help_pointer())

