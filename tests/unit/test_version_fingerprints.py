"""Per-version fingerprints of the megatron-core functions the patches replace or wrap: the table made from
Megatron-LM's tags matches the installed release, a changed function refuses only the features patching it (one
line naming it), a megatron-core outside the range warns once and serves what matches."""

import ast
import inspect
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from mm_adaptor.versions import contracts

from mm_adaptor.versions import fingerprint_cache, source_fingerprint
from mm_adaptor.versions.fingerprint_table import BASE, FINGERPRINTS
from mm_adaptor.core.patching import Contract, Patch, PatchContractError, PatchContractWarning, PatchSet, resolve
from mm_adaptor.versions.serving import (_switched_on, feature_states, feature_version_report,
                                         registered_megatron_patches)

ROOT = Path(__file__).resolve().parents[2]
CHANGED = "megatron.core.transformer.mlp.MLP.forward"
on_base = pytest.mark.skipif(contracts.installed_version() != BASE,
                             reason=f"the installed megatron-core is not the table's base {BASE}")


@pytest.fixture(scope="module")
def registered():
    errors = []
    patches = registered_megatron_patches(errors)
    assert all(e.startswith("npu.device_patch_sets") for e in errors), errors  # only torch_npu may be missing
    return patches


@pytest.fixture(autouse=True)
def fresh_live_cache(monkeypatch):
    monkeypatch.setattr(contracts, "_live", {})
    monkeypatch.setattr(contracts, "_warned_range", set())


def installed_megatron_core(patch) -> bool:
    module = source_fingerprint.installed_module(patch.target)
    return module is not None and module.startswith("megatron.core")


# --- the table ---------------------------------------------------------------------------------------------


def test_every_registered_target_has_fingerprints(registered):
    owners = {p.owner for p in registered}
    assert {"fused-swiglu", "optimize-vocab-parallel-ce", "device:cpu:megatron-core", "megatron-lm:arguments",
            "compat:rope-fusion"} <= owners, owners
    missing = sorted({p.target for p in registered} - set(FINGERPRINTS))
    assert not missing, f"run scripts/fingerprint_megatron.py: no fingerprints for {missing}"


@on_base
def test_table_matches_the_installed_release_for_every_registered_target(registered):
    targets = sorted({p.target for p in registered if installed_megatron_core(p)})
    assert len(targets) > 40
    differing = {t: (FINGERPRINTS[t][BASE], contracts.live_fingerprint(t)) for t in targets
                 if FINGERPRINTS[t][BASE] != contracts.live_fingerprint(t)}
    assert not differing


def test_the_source_resolution_finds_the_object_python_imports(registered):
    """The fingerprint is read from the definition the static resolution finds; it must be the live object's."""
    checked = 0
    resolver = source_fingerprint.Resolver(source_fingerprint.installed_source)
    for target in sorted({p.target for p in registered if installed_megatron_core(p)}):
        if contracts.live_fingerprint(target) is None:  # not defined in this release (GroupedMLP from 0.17 on)
            continue
        owner, name = resolve(target)
        original, _own = Patch._raw_attribute(owner, name)
        live = contracts._underlying(original)
        if not (inspect.isfunction(live) or inspect.isclass(live)):
            continue
        found = resolver.find(target)
        assert found is not None, target
        lines, first = inspect.getsourcelines(live)
        node = found.statements[-1]
        assert inspect.getsourcefile(live).endswith(found.module.replace(".", "/") + ".py"), target
        assert node.lineno <= first + len(lines) - 1 and first <= node.end_lineno, target
        checked += 1
    assert checked > 40


# --- normalisation -----------------------------------------------------------------------------------------

V1 = '''
from pkg.base import Base

def f(x, y=2):
    """Adds."""
    return x + y  # the sum

class C(Base):
    def g(self):
        return 1
'''
BASE_SOURCE = '''
class Base:
    def h(self):
        return "base"
'''


def reader(sources):
    return lambda module: sources.get(module)


def print_of(target, source):
    return source_fingerprint.fingerprint_target(target, reader({"pkg.mod": source, "pkg.base": BASE_SOURCE}))


def test_comments_docstrings_and_formatting_do_not_count_but_code_does():
    same = V1.replace('"""Adds."""', '"""Adds two numbers."""').replace("# the sum", "").replace(
        "return x + y", "return (x +\n            y)")
    assert print_of("pkg.mod.f", same) == print_of("pkg.mod.f", V1)
    assert print_of("pkg.mod.f", V1.replace("x + y", "x - y")) != print_of("pkg.mod.f", V1)
    assert print_of("pkg.mod.C.g", V1.replace("x + y", "x - y")) == print_of("pkg.mod.C.g", V1)
    assert print_of("pkg.mod.nothing", V1) is None


def test_fields_a_newer_python_adds_empty_do_not_count(monkeypatch):
    """Python 3.12 added FunctionDef.type_params (empty here): the table made on one Python must match on another."""
    node = ast.parse("def f(x):\n    return x\n").body[0]
    before = source_fingerprint.fingerprint_statements([node])
    monkeypatch.setattr(ast.FunctionDef, "_fields", (*ast.FunctionDef._fields, "added_later"))
    node.added_later = []
    assert source_fingerprint.fingerprint_statements([node]) == before
    node.added_later = [ast.Name("T")]
    assert source_fingerprint.fingerprint_statements([node]) != before


def test_inherited_methods_are_found_in_the_base_module():
    inherited = print_of("pkg.mod.C.h", V1)
    assert inherited is not None
    assert inherited == source_fingerprint.fingerprint_target("pkg.base.Base.h", reader({"pkg.base": BASE_SOURCE}))


def test_signature_only_ignores_the_body_not_the_parameters():
    def sig(source):
        return source_fingerprint.fingerprint_target("pkg.mod.f", reader({"pkg.mod": source}), signature_only=True)

    assert sig(V1) == sig(V1.replace("x + y", "x * y + 1")) == sig(V1.replace("def f(x, y=2)", "def f(x: int, y=2)"))
    assert sig(V1) != sig(V1.replace("def f(x, y=2)", "def f(x, y=3)"))
    assert sig(V1) != sig(V1.replace("def f(x, y=2)", "def f(x, y=2, *, z=None)"))


# --- a changed upstream function ---------------------------------------------------------------------------


def edit_one_line(target):
    """The installed sources with one statement added at the end of `target`'s body."""
    installed = source_fingerprint.installed_source
    found = source_fingerprint.Resolver(installed).find(target)
    last = found.statements[-1].body[-1]
    lines = found.source.splitlines(keepends=True)
    lines.insert(last.end_lineno, " " * last.col_offset + "pass\n")
    edited = "".join(lines)
    return lambda module: edited if module == found.module else installed(module)


@pytest.fixture
def mlp_forward_changed(monkeypatch):
    for name in ("fused-swiglu", "recompute-activation-function"):  # as if verified on the base release only
        monkeypatch.setitem(contracts.VERIFIED_ON, name, (BASE,))
    monkeypatch.setattr(source_fingerprint, "installed_source", edit_one_line(CHANGED))
    monkeypatch.setattr(fingerprint_cache, "_current", lambda: None)  # the files on disk did not change
    assert contracts.live_fingerprint(CHANGED) != FINGERPRINTS[CHANGED][BASE]


def apply_feature(name):
    from mm_adaptor.core import features
    feature = features.get(name)
    sets = feature.patch_sets(_switched_on(feature))
    done = []
    try:
        for patch_set in sets:
            patch_set.apply()
            done.append(patch_set)
    finally:
        for patch_set in reversed(done):
            patch_set.revert()


@on_base
def test_a_changed_function_refuses_only_the_features_patching_it_in_one_line(mlp_forward_changed, registered):
    touching = {p.owner for p in registered if p.target == CHANGED}
    assert {"fused-swiglu", "recompute-activation-function"} <= touching
    for name in ("fused-swiglu", "recompute-activation-function"):
        with pytest.raises(PatchContractError) as info:
            apply_feature(name)
        message = str(info.value)
        assert "\n" not in message and f"{CHANGED} changed in megatron-core {BASE}" in message, message
        assert message.startswith(f"feature {name!r} refuses: {CHANGED} changed in megatron-core {BASE} (its code "
                                  f"differs from {BASE}, where it was verified)"), message
    for name in ("optimize-vocab-parallel-ce", "fused-rmsnorm", "fused-rotary-pos-emb"):
        apply_feature(name)
    states = {s.name: s for s in feature_states()}
    assert {name for name, s in states.items() if s.refusals} == touching
    assert all(len(states[name].refusals) == 1 and CHANGED in states[name].refusals[0] for name in touching)
    report = "\n".join(feature_version_report())
    assert f"fused-swiglu: verified on {BASE}; refuses: {CHANGED} changed" in report


@on_base
def test_the_allow_mismatch_variable_downgrades_a_changed_function_to_one_warning(mlp_forward_changed, monkeypatch):
    monkeypatch.setenv(contracts.ALLOW_MISMATCH_ENV, "1")
    with pytest.warns(PatchContractWarning, match=CHANGED.replace(".", r"\.") + ".*applied anyway"):
        apply_feature("fused-swiglu")


def test_a_feature_verified_on_a_later_release_serves_its_code_too(monkeypatch):
    """A version recorded as verified is enough: the installed code matching any of them serves."""
    later = {v: p for v, p in FINGERPRINTS[CHANGED].items() if v != BASE and p != FINGERPRINTS[CHANGED][BASE]}
    version, later_print = sorted(later.items())[0]
    monkeypatch.setattr(contracts, "live_fingerprint", lambda target: later_print)
    monkeypatch.setitem(contracts.VERIFIED_ON, "fused-swiglu", (BASE, version))
    monkeypatch.setitem(contracts.VERIFIED_ON, "recompute-activation-function", (BASE,))
    assert contracts.megatron_problem("fused-swiglu", CHANGED, "9.9") is None
    assert CHANGED in contracts.megatron_problem("recompute-activation-function", CHANGED, "9.9")
    monkeypatch.setitem(contracts.VERIFIED_ON, "fused-swiglu", (BASE,))
    assert CHANGED in contracts.megatron_problem("fused-swiglu", CHANGED, "9.9")


# --- versions outside the range ----------------------------------------------------------------------------


@on_base
def test_outside_the_range_warns_once_and_serves_what_matches(monkeypatch):
    monkeypatch.setattr(contracts, "installed_version", lambda package="megatron-core": "0.20.1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("optimize-vocab-parallel-ce", "fused-swiglu", "fused-rmsnorm"):
            apply_feature(name)
    said = [w for w in caught if issubclass(w.category, contracts.MegatronVersionWarning)]
    assert len(said) == 1 and "megatron-core 0.20.1 is outside" in str(said[0].message)


@on_base
def test_outside_the_range_a_changed_function_still_refuses_by_name(monkeypatch, mlp_forward_changed):
    monkeypatch.setattr(contracts, "installed_version", lambda package="megatron-core": "0.20.1")
    with pytest.warns(contracts.MegatronVersionWarning), pytest.raises(PatchContractError, match="MLP.forward"):
        apply_feature("fused-swiglu")


def test_a_target_without_fingerprints_serves_only_on_a_verified_version(monkeypatch):
    patch_set = PatchSet("demo")
    patch_set.wrap("megatron.core.utils.divide", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs),
                   contract=Contract(versions=contracts.SUPPORTED_MEGATRON_CORE))
    monkeypatch.setattr(contracts, "recorded_fingerprints", lambda target: None)
    monkeypatch.setattr(contracts, "installed_version", lambda package="megatron-core": BASE)
    patch_set.apply()
    patch_set.revert()
    monkeypatch.setattr(contracts, "installed_version", lambda package="megatron-core": "0.17.0")
    with pytest.raises(PatchContractError, match="no fingerprint of megatron.core.utils.divide is recorded"):
        patch_set.apply()
    assert not patch_set.applied


def test_a_wrong_table_entry_is_rejected(monkeypatch):
    """A table whose base fingerprint is not the installed code's refuses: the table is what is compared."""
    monkeypatch.setitem(FINGERPRINTS, "megatron.core.utils.divide", {BASE: "0123456789abcdef"})
    monkeypatch.setattr(contracts, "installed_version", lambda package="megatron-core": BASE)
    patch = Patch("megatron.core.utils.divide", lambda w, i, a, k: w(*a, **k), mode="wrap", feature="demo",
                  contract=Contract(versions=contracts.SUPPORTED_MEGATRON_CORE))
    with pytest.raises(PatchContractError, match="megatron.core.utils.divide changed"):
        patch.apply()


def test_the_explicit_pin_still_counts_next_to_the_table(monkeypatch):
    monkeypatch.setattr(contracts, "installed_version", lambda package="megatron-core": BASE)
    monkeypatch.setitem(FINGERPRINTS, "megatron.core.utils.divide",
                        {BASE: contracts.live_fingerprint("megatron.core.utils.divide")})
    patch = Patch("megatron.core.utils.divide", lambda w, i, a, k: w(*a, **k), mode="wrap", feature="demo",
                  contract=Contract(versions=contracts.SUPPORTED_MEGATRON_CORE, fingerprint="0123456789abcdef"))
    with pytest.raises(PatchContractError, match="the original's source changed"):
        patch.apply()


# --- the generator -----------------------------------------------------------------------------------------


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_the_script_fingerprints_each_tag_from_its_source(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import fingerprint_megatron
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    repo = tmp_path / "lm"
    (repo / "megatron" / "core").mkdir(parents=True)
    module = repo / "megatron" / "core" / "mod.py"
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "t")
    for tag, body in (("core_v1.0.0", V1), ("core_v1.1.0", V1.replace("# the sum", "# sum")),
                      ("core_v1.2.0", V1.replace("x + y", "x - y")), ("core_v1.3.0", "")):
        module.write_text(body)
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", tag, "--allow-empty")
        git(repo, "tag", tag)
    namespace = {}
    exec(fingerprint_megatron.build(str(repo / ".git"), ["core_v1.0.0", "core_v1.1.0", "core_v1.2.0", "core_v1.3.0"],
                                    ["megatron.core.mod.f"]), namespace)
    prints = namespace["FINGERPRINTS"]["megatron.core.mod.f"]
    assert prints["1.0.0"] == prints["1.1.0"] != prints["1.2.0"] and prints["1.3.0"] is None
    first = source_fingerprint.fingerprint_target("megatron.core.mod.f", reader({"megatron.core.mod": V1}))
    assert prints["1.0.0"] == first
    assert namespace["CHANGED_LINES"]["megatron.core.mod.f"] == {"1.1.0": 0, "1.2.0": 2, "1.3.0": 3}


def test_importing_the_adaptor_beside_a_release_outside_the_range_warns_once(tmp_path):
    """A stand-in distribution's metadata says megatron-core 0.20.1 (the code stays the installed one)."""
    info = tmp_path / "megatron_core-0.20.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.20.1\n")
    script = ("import warnings; warnings.simplefilter('always')\n"
              "import mm_adaptor.core.patching, mm_adaptor.core.features\n"
              "from mm_adaptor.versions import contracts\n"
              "assert contracts.installed_version() == '0.20.1'\n"
              "contracts.warn_if_outside_range()\n"
              "print(contracts.megatron_problem('optimize-vocab-parallel-ce', "
              "'megatron.core.tensor_parallel.cross_entropy.VocabParallelCrossEntropy.calculate_predicted_logits', "
              "'0.20.1'))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONWARNINGS": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count("megatron-core 0.20.1 is outside the versions") == 1, result.stderr[-2000:]
    assert result.stdout.strip() == "None"  # unchanged code serves
