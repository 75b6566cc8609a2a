"""Fill the generated blocks of README.md and docs/features/*.md from the feature registry.

    python -m mm_adaptor.cli.docs_gen            # rewrite the blocks
    python -m mm_adaptor.cli.docs_gen --check    # exit 1, naming each file and block, when a block is stale

A block is the text between `<!-- generated:NAME -->` and `<!-- /generated -->`; everything outside the blocks is
written by hand. What goes in them comes from the code, so the documents cannot drift from it:
- README.md, block `features-table`: one row per feature (main flag and tuning flags, the one line its page gives
  after `**What it buys:**`, the tolerance, the devices mm_adaptor/core/verification.py records it as verified on, and
  the link to its page);
- docs/features/<name>.md, block `flags`: every flag with its type, default and help, the tolerance and its reason,
  the features it requires or conflicts with, and the refusals: each message is what the feature's own validate()
  raises for a probe configuration its declaration lists (refusal_probes; one that no longer refuses is an error);
- docs/features/<name>.md, block `devices`: the state and evidence of each device and the megatron-core releases
  the feature is verified on, from its declaration (devices, verified_on);
- docs/devices.md, block `devices-matrix`: every feature's state on every device, and each backend's record;
- docs/mindspeed-mm.md, block `mindspeed-mm-arguments`: every argument of MindSpeed-MM's Qwen2.5-VL fine-tuning
  scripts and what it does here (mm_adaptor/mindspeed_mm/arguments.py).

The features documented are the built-in ones (modules under mm_adaptor.feature_flags); a feature added there
without a page makes the check fail."""

from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
from pathlib import Path

BEGIN = "<!-- generated:{name} -->"
END = "<!-- /generated -->"
BLOCK = re.compile(r"<!-- generated:(?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /generated -->", re.S)
SUMMARY = re.compile(r"^\*\*What it buys:\*\* (?P<text>.+)$", re.M)
ROOT = Path(__file__).resolve().parents[2]

# The options every refusal probe (Feature.refusal_probes) starts from.
_LOCAL = {"transformer_impl": "local"}


def builtin_features():
    from mm_adaptor.core import features
    return features.built_in_features()


def page_path(root: Path, feature) -> Path:
    return root / "docs" / "features" / f"{feature.name}.md"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _type_name(flag) -> str:
    if flag.is_switch:
        return "switch"
    name = getattr(flag.type, "__name__", str(flag.type))
    return f"{name}, value optional" if flag.value_optional else name


def _default(flag) -> str:
    if flag.is_switch:
        return "off"
    if flag.value_optional:
        const = "all" if flag.const == math.inf else f"{flag.const!r}"
        return f"off; alone: {const}"
    return "unset" if flag.default is None else f"`{flag.default!r}`"


def tolerance_short(feature) -> str:
    tol = feature.tolerance
    if tol.exact:
        return "bit-for-bit"
    return "calibrated" + (f" x{tol.factor:g}" if tol.factor != 1 else "")


def devices_short(feature) -> str:
    from mm_adaptor.core import verification
    records = {d: verification.record(feature.name, d) for d in verification.DEVICES}
    verified = [d.upper() for d, r in records.items() if r.state == "verified"]
    stand_in = [d.upper() for d, r in records.items() if r.state == "stand-in"]
    text = ", ".join(verified) or "none"
    if stand_in:
        text += f" (stand-in: {', '.join(stand_in)})"
    return text


def summary_of(root: Path, feature) -> str:
    path = page_path(root, feature)
    if not path.exists():
        return f"(no page: write {path.relative_to(root)})"
    match = SUMMARY.search(path.read_text())
    return match.group("text").strip() if match else "(its page has no `**What it buys:**` line)"


def features_table(root: Path, features) -> str:
    rows = ["| flag | what it buys | tolerance | verified on | page |", "|---|---|---|---|---|"]
    for feature in sorted(features, key=lambda f: f.name):
        tuning = " ".join(f"[`{flag.option}`]" for flag in feature.flags[1:])
        main = feature.main_flag
        flag = f"`{main.option}`" + (" [value]" if main.value_optional else "") + (f" {tuning}" if tuning else "")
        rows.append(f"| {flag} | {_cell(summary_of(root, feature))} | {tolerance_short(feature)} | "
                    f"{devices_short(feature)} | [{feature.name}](docs/features/{feature.name}.md) |")
    return "\n".join(rows) + "\n"


def _probe_options(settings: dict):
    from mm_adaptor.core import features
    options = argparse.Namespace(**_LOCAL)
    features.fill_defaults(options)
    for key, value in settings.items():
        setattr(options, key, value)
    return options


def refusals(feature) -> list[tuple[str, str]]:
    """(probe, message) for each probe of the feature; a probe the feature accepts is an error."""
    from mm_adaptor.core.features import FeatureConfigError

    found = []
    for label, settings in feature.refusal_probes:
        options = _probe_options(settings)
        try:
            feature.validate(options)
        except FeatureConfigError as error:
            found.append((label, str(error)))
            continue
        raise SystemExit(f"docs_gen: {feature.name} no longer refuses the probe {label!r} ({settings}); "
                         f"update its refusal_probes in feature_flags/")
    return found


def flags_block(feature) -> str:
    lines = ["| flag | type | default | Megatron-LM's own | what it does |", "|---|---|---|---|---|"]
    for flag in feature.flags:
        choices = f" (one of {', '.join(map(str, flag.choices))})" if flag.choices else ""
        lines.append(f"| `{flag.option}` | {_type_name(flag)}{choices} | {_default(flag)} | "
                     f"{'yes' if flag.megatron_owned else 'no'} | {_cell(flag.help)} |")
    lines.append("")
    lines.append(f"Tolerance against unpatched Megatron: **{_cell(feature.tolerance.describe())}**.")
    lines.append("")
    from mm_adaptor.core import features
    def names(which):
        return ", ".join(f"`{features.get(n).main_flag.option}`" for n in which) or "none"

    lines.append(f"Requires (registry): {names(feature.requires)}. Conflicts (registry): {names(feature.conflicts)}.")
    found = refusals(feature)
    if found:
        lines.append("")
        lines.append("Refusals, each the feature's own one-line message for a probe configuration:")
        lines.append("")
        for label, message in found:
            lines.append(f"- {label}: `{message}`")
    return "\n".join(lines) + "\n"


def megatron_versions(feature) -> str:
    return ", ".join(feature.verified_on)


def devices_block(feature) -> str:
    from mm_adaptor.core import verification
    lines = ["| device | state | evidence |", "|---|---|---|"]
    for device in verification.DEVICES:
        record = verification.record(feature.name, device)
        lines.append(f"| {device} | {record.state} | {_cell(record.evidence)} |")
    lines.append("")
    lines.append(f"Verified on megatron-core {megatron_versions(feature)} (on another release the feature serves "
                 f"only where the functions it patches have the code of one of these):")
    lines.append("")
    for version, reason in feature.verified_on.items():
        lines.append(f"- {version}: {reason}")
    return "\n".join(lines) + "\n"


def devices_matrix(features) -> str:
    from mm_adaptor.core import verification
    lines = ["| feature | " + " | ".join(verification.DEVICES) + " | megatron-core verified |",
             "|---|" + "---|" * (len(verification.DEVICES) + 1)]
    for feature in sorted(features, key=lambda f: f.name):
        states = " | ".join(verification.record(feature.name, d).state for d in verification.DEVICES)
        lines.append(f"| [{feature.name}](features/{feature.name}.md) | {states} | {megatron_versions(feature)} |")
    lines.append("")
    for device in verification.DEVICES:
        backend = verification.BACKENDS.get(device, verification.UNRECORDED)
        lines.append(f"- backend `{device}`: {backend.state}: {backend.evidence}")
    return "\n".join(lines) + "\n"


def fill(text: str, blocks: dict[str, str]) -> tuple[str, list[str]]:
    """The text with each named block's body replaced; and the names of blocks the text lacks."""
    seen = set()

    def replace(match):
        name = match.group("name")
        if name not in blocks:
            return match.group(0)
        seen.add(name)
        return f"{BEGIN.format(name=name)}\n{blocks[name]}{END}"

    return BLOCK.sub(replace, text), sorted(set(blocks) - seen)


def expected(root: Path = ROOT, features=None) -> tuple[dict[Path, str], list[str]]:
    """Each documented file as it should read, and the problems that regenerating cannot fix (missing pages or
    markers)."""
    features = builtin_features() if features is None else list(features)
    problems, wanted = [], {}
    readme = root / "README.md"
    text, missing = fill(readme.read_text(), {"features-table": features_table(root, features)})
    wanted[readme] = text
    problems += [f"README.md: no <!-- generated:{name} --> block" for name in missing]
    devices = root / "docs" / "devices.md"
    if devices.exists():
        text, missing = fill(devices.read_text(), {"devices-matrix": devices_matrix(features)})
        wanted[devices] = text
        problems += [f"docs/devices.md: no <!-- generated:{name} --> block" for name in missing]
    migration = root / "docs" / "mindspeed-mm.md"
    if migration.exists():
        from mm_adaptor.mindspeed_mm.arguments import markdown_table

        text, missing = fill(migration.read_text(), {"mindspeed-mm-arguments": markdown_table()})
        wanted[migration] = text
        problems += [f"docs/mindspeed-mm.md: no <!-- generated:{name} --> block" for name in missing]
    for feature in features:
        path = page_path(root, feature)
        if not path.exists():
            problems.append(f"{path.relative_to(root)}: missing (feature {feature.name!r} has no page; copy one of "
                            f"docs/features/*.md, keep its generated blocks, and regenerate)")
            continue
        text, missing = fill(path.read_text(), {"flags": flags_block(feature), "devices": devices_block(feature)})
        wanted[path] = text
        problems += [f"{path.relative_to(root)}: no <!-- generated:{name} --> block" for name in missing]
        if not SUMMARY.search(text):
            problems.append(f"{path.relative_to(root)}: no `**What it buys:** ...` line for the README's table")
    return wanted, problems


def stale(root: Path = ROOT, features=None) -> list[str]:
    """One entry per problem: a file whose generated blocks differ from the registry (with a short diff), or a
    missing page or block. Empty when the docs say what the code says."""
    wanted, problems = expected(root, features)
    for path, text in wanted.items():
        current = path.read_text()
        if current != text:
            diff = difflib.unified_diff(current.splitlines(), text.splitlines(), "committed", "from the registry",
                                        lineterm="", n=0)
            problems.append(f"{path.relative_to(root)} differs from the registry:\n" + "\n".join(list(diff)[:40]))
    return problems


def write(root: Path = ROOT, features=None) -> tuple[list[Path], list[str]]:
    """Rewrite the stale blocks; returns the files rewritten and the problems left (missing pages or blocks)."""
    wanted, problems = expected(root, features)
    changed = []
    for path, text in wanted.items():
        if path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mm_adaptor.cli.docs_gen", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="report stale blocks and exit 1 instead of writing")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale(args.root)
        for problem in problems:
            print(f"docs_gen: {problem}")
        if problems:
            print("docs_gen: run `python -m mm_adaptor.cli.docs_gen` and commit the result")
        return 1 if problems else 0
    changed, problems = write(args.root)
    for path in changed:
        print(f"rewrote {path.relative_to(args.root)}")
    for problem in problems:
        print(f"docs_gen: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
