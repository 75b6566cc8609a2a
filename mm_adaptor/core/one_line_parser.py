"""The parser of every `mm-adaptor` command: an error is one line, `PROG: error: MESSAGE`, exit status 2, no usage
block; an unknown flag names the closest valid ones. Imports nothing heavy, so errors and --help stay fast."""

from __future__ import annotations

import argparse
import difflib
import sys


def closest(word: str, candidates) -> list[str]:
    """Up to three candidates nearly as close to `word` as the closest one."""
    scored = []
    for candidate in dict.fromkeys(candidates):
        ratio = difflib.SequenceMatcher(None, word, candidate).ratio()
        if ratio >= 0.6:
            scored.append((ratio, candidate))
    scored.sort(key=lambda pair: -pair[0])
    return [candidate for ratio, candidate in scored[:3] if ratio >= scored[0][0] - 0.05]


def did_you_mean(word: str, candidates) -> str:
    matches = closest(word, candidates)
    return f"did you mean {' or '.join(matches)}?" if matches else ""


def count(text: str) -> int:
    """An argument type: a whole number of 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: want 0 or more")
    return value


def _is_flag(token: str) -> bool:
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)
    except ValueError:
        return True
    return False  # a negative number


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors. With exit_on_error=False an error raises argparse.ArgumentError (one line)
    instead of exiting. `also_valid`: flags another parser of the same command accepts, offered as suggestions."""

    def __init__(self, *args, also_valid=(), help_hint: str | None = None, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.also_valid = list(also_valid)
        self.help_hint = help_hint or f"`{self.prog} --help` lists every flag"
        self._parsing = False

    def flags(self) -> list[str]:
        return [option for option in self._option_string_actions if option.startswith("--")] + self.also_valid

    def parse_known_args(self, args=None, namespace=None):
        self._parsing = True
        try:
            return super().parse_known_args(args, namespace)
        finally:
            self._parsing = False

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.fail(self.unrecognized(extras) + self.help_pointer())
        return namespace

    def unrecognized(self, extras: list[str]) -> str:
        flags = [token for token in extras if _is_flag(token)]
        if not flags:
            return f"unexpected value{'s' if len(extras) > 1 else ''} {' '.join(extras)}: no flag takes it"
        named = []
        for token in flags:
            name = token.split("=", 1)[0]
            hint = did_you_mean(name, self.flags())
            named.append((name, hint))
        if len(named) == 1:
            name, hint = named[0]
            return f"unrecognized argument {name}" + (f": {hint}" if hint else "")
        return "unrecognized arguments " + ", ".join(f"{name} ({hint})" if hint else name for name, hint in named)

    def help_pointer(self) -> str:
        return f" ({self.help_hint})"

    def error(self, message: str):
        """argparse's own errors (bad or missing values) get the --help pointer; validation errors name the fix."""
        self.fail(" ".join(message.split()) + self.help_pointer() if self._parsing else message)

    def fail(self, message: str):
        """One line per line of `message`, then exit 2 (or raise argparse.ArgumentError, see the class)."""
        lines = [" ".join(line.split()) for line in str(message).splitlines() if line.strip()]
        if not self.exit_on_error:
            raise argparse.ArgumentError(None, "\n".join(lines))
        sys.stderr.write("".join(f"{self.prog}: error: {line}\n" for line in lines))
        sys.exit(2)
