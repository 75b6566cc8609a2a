"""The generated blocks of README.md and docs/ say what the feature registry and mm_adaptor/core/verification.py say,
and the check notices when they stop doing so (a feature or a flag added without regenerating)."""

import dataclasses

import pytest

from mm_adaptor.cli import docs_gen

from mm_adaptor.core import features
from mm_adaptor.core.features import Feature, Flag


def test_committed_docs_match_the_registry():
    problems = docs_gen.stale()
    assert not problems, "\n".join(problems) + "\nrun `python -m mm_adaptor.cli.docs_gen` and commit the result"


def test_every_builtin_feature_has_a_page_linked_from_the_readme():
    readme = (docs_gen.ROOT / "README.md").read_text()
    for feature in docs_gen.builtin_features():
        assert docs_gen.page_path(docs_gen.ROOT, feature).exists(), feature.name
        assert f"(docs/features/{feature.name}.md)" in readme, feature.name


@pytest.fixture
def throwaway_feature():
    """A feature registered the way a new module in feature_flags/ would be, without any page or regeneration."""

    class Throwaway(Feature):
        name = "throwaway-docs-probe"
        description = "a feature that exists only in this test"
        flags = (Flag("--use-throwaway-docs-probe", "only in this test"),)

        def patch_sets(self, options):
            return []

    Throwaway.__module__ = features.BUILT_IN_PACKAGE + ".throwaway_docs_probe"
    features.register(Throwaway)
    try:
        yield Throwaway
    finally:
        features.unregister(Throwaway.name)


def test_a_feature_added_without_regenerating_fails_the_check(throwaway_feature):
    problems = docs_gen.stale()
    text = "\n".join(problems)
    assert "docs/features/throwaway-docs-probe.md: missing" in text
    assert "README.md differs from the registry" in text
    assert "--use-throwaway-docs-probe" in text  # the diff shows the row the table lacks
    assert docs_gen.main(["--check"]) == 1


def test_a_flag_added_to_a_feature_without_regenerating_fails_the_check(monkeypatch):
    feature = features.get("swap-attention")
    extra = Flag("--swap-throwaway-probe", "only in this test", type=int, default=3)
    monkeypatch.setattr(type(feature), "flags", (*feature.flags, extra))
    problems = docs_gen.stale()
    text = "\n".join(problems)
    assert "docs/features/swap-attention.md differs from the registry" in text
    assert "--swap-throwaway-probe" in text


def test_a_changed_verification_record_fails_the_check(monkeypatch):
    coc = features.get("coc")
    records = dict(coc.devices)
    records["cuda"] = dataclasses.replace(records["cuda"], evidence="a run that is only in this test")
    monkeypatch.setattr(coc, "devices", records)
    text = "\n".join(docs_gen.stale())
    assert "docs/features/coc.md differs from the registry" in text


def test_a_megatron_release_verified_without_regenerating_fails_the_check(monkeypatch):
    feature = features.get("optimize-vocab-parallel-ce")
    monkeypatch.setattr(feature, "verified_on", {**feature.verified_on, "9.9.9": "a run that is only in this test"})
    text = "\n".join(docs_gen.stale())
    assert "docs/features/optimize-vocab-parallel-ce.md differs from the registry" in text
    assert "docs/devices.md differs from the registry" in text


def test_a_probe_that_no_longer_refuses_is_an_error(monkeypatch):
    monkeypatch.setattr(features.get("swap-attention"), "refusal_probes", (("accepted", {"swap_attention": True}),))
    with pytest.raises(SystemExit, match="no longer refuses"):
        docs_gen.refusals(features.get("swap-attention"))


def test_regenerating_writes_the_blocks_and_nothing_else(tmp_path):
    page = tmp_path / "docs" / "features"
    page.mkdir(parents=True)
    block = "<!-- generated:{} -->\nold\n<!-- /generated -->\n"
    (tmp_path / "docs" / "devices.md").write_text("intro\n" + block.format("devices-matrix"))
    (tmp_path / "README.md").write_text("# title\n\n" + block.format("features-table") + "tail\n")
    for feature in docs_gen.builtin_features():
        (page / f"{feature.name}.md").write_text(
            f"# {feature.name}\n\n**What it buys:** one line\n\nhand-written\n\n"
            "<!-- generated:flags -->\n<!-- /generated -->\n\n<!-- generated:devices -->\nold\n<!-- /generated -->\n")
    assert docs_gen.stale(tmp_path)
    docs_gen.write(tmp_path)
    assert docs_gen.stale(tmp_path) == []
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("# title\n\n") and readme.endswith("<!-- /generated -->\ntail\n")
    assert "| one line |" in readme
    swap = (page / "swap-attention.md").read_text()
    assert "hand-written" in swap and "`--swap-min-bytes`" in swap and "| cpu | verified |" in swap


# Written by other work in progress; a link to them is allowed before they exist.
_LINKED_BEFORE_WRITTEN = {"docs/npu.md", "benchmarks/megatron_0_19_trial.md"}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), spaces as hyphens."""
    import re

    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_and_anchors_in_the_docs_resolve():
    import os
    import re

    root = docs_gen.ROOT
    files = [root / "README.md", root / "CONTRIBUTING.md", root / "benchmarks" / "RESULTS.md",
             *sorted((root / "docs").rglob("*.md"))]
    files = [f for f in files if f.exists()]

    def headings(path):
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}

    broken = []
    for path in files:
        for link in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", link):
                continue
            target, _, anchor = link.partition("#")
            resolved = path if not target else (path.parent / target)
            relative = os.path.relpath(os.path.normpath(resolved), root)
            if not resolved.exists():
                if relative not in _LINKED_BEFORE_WRITTEN:
                    broken.append(f"{path.relative_to(root)}: {link} (no such file)")
                continue
            if anchor and resolved.suffix == ".md" and anchor not in headings(resolved):
                broken.append(f"{path.relative_to(root)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)
