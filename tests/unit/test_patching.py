"""mm_adaptor.core.patching: replace/wrap, contracts, by-value copies, descriptors, stacking, PatchSet."""

import functools
import importlib
import importlib.metadata
import inspect
import sys
import textwrap
import uuid

import pytest

from mm_adaptor.versions import contracts
from mm_adaptor.core.patching import (
    ALLOW_MISMATCH_ENV,
    Contract,
    Patch,
    PatchContractError,
    PatchContractWarning,
    PatchError,
    PatchSet,
    active_patches,
    fingerprint,
    resolve,
)

A_SOURCE = '''
def f(x):
    return x + 1

class Base:
    def method(self, x):
        return x * 2

    @staticmethod
    def static(x):
        return x - 1

    @classmethod
    def make(cls, x):
        return (cls.__name__, x)

    @property
    def value(self):
        return 10

class Child(Base):
    pass

class GrandChild(Child):
    pass
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A throwaway package: `a` defines things, `b` holds a by-value copy of a.f."""
    name = f"fakepkg_{uuid.uuid4().hex[:10]}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text(textwrap.dedent(A_SOURCE))
    (root / "b.py").write_text(f"from {name}.a import f\n\n\ndef call_f(x):\n    return f(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    a = importlib.import_module(f"{name}.a")
    b = importlib.import_module(f"{name}.b")
    yield name, a, b
    for module_name in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module_name]


@pytest.fixture(autouse=True)
def no_leaked_patches():
    before = active_patches()
    yield
    leaked = [p for p in active_patches() if p not in before]
    for patch in reversed(leaked):
        patch.revert()
    assert not leaked, f"test left patches applied: {leaked}"


def add_ten(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 10


def installed_pytest() -> str:
    return importlib.metadata.version("pytest")


# --- replace / wrap ------------------------------------------------------------------------------


def test_replace_apply_revert_restores_identity(fake):
    name, a, _ = fake
    original = a.f
    patch = Patch(f"{name}.a.f", lambda x: -x, mode="replace", feature="demo")
    patch.apply()
    assert a.f(3) == -3 and patch.applied and patch.original is original
    assert active_patches()[-1] is patch
    patch.revert()
    assert a.f is original and not patch.applied and patch not in active_patches()


def test_wrap_calls_through_and_preserves_signature(fake):
    name, a, _ = fake
    seen = []

    def spy(wrapped, instance, args, kwargs):
        seen.append((instance, args, kwargs))
        return wrapped(*args, **kwargs) * 100

    signature = inspect.signature(a.f)
    patch = Patch(f"{name}.a.f", spy, mode="wrap")
    patch.apply()
    try:
        assert a.f(x=2) == 300
        assert seen == [(None, (), {"x": 2})]
        assert inspect.signature(a.f) == signature
    finally:
        patch.revert()


def test_wrap_of_a_method_sees_the_instance(fake):
    name, a, _ = fake
    seen = []

    def spy(wrapped, instance, args, kwargs):
        seen.append(instance)
        return wrapped(*args, **kwargs)

    patch = Patch(f"{name}.a.Base.method", spy, mode="wrap")
    patch.apply()
    try:
        obj = a.Base()
        assert obj.method(4) == 8 and seen == [obj]
        assert list(inspect.signature(a.Base.method).parameters) == ["self", "x"]
    finally:
        patch.revert()


def test_a_wrapper_counts_its_calls_and_a_replacement_is_not_counted(fake):
    """The count is what tests read to show a feature's code ran rather than megatron's alone."""
    name, a, _ = fake
    wrap = Patch(f"{name}.a.Base.static", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs),
                 mode="wrap")
    replace = Patch(f"{name}.a.f", lambda x: x, mode="replace")
    wrap.apply()
    replace.apply()
    try:
        assert wrap.calls == 0
        a.Base.static(1), a.Base().static(2), a.f(3)
        assert wrap.calls == 2 and replace.calls is None
    finally:
        replace.revert()
        wrap.revert()
    wrap.apply()
    try:
        assert wrap.calls == 0, "a new application counts from zero"
    finally:
        wrap.revert()


def test_unknown_mode_raises_value_error():
    for mode in ("", "wrapper", "Replace", None):
        with pytest.raises(ValueError, match="replace"):
            Patch("os.path.join", add_ten, mode=mode)


def test_read_only_properties_and_repr(fake):
    name, _, _ = fake
    patch = Patch(f"{name}.a.f", add_ten, mode="wrap", feature="demo")
    assert (patch.target, patch.mode, patch.feature, patch.applied, patch.original) == (
        f"{name}.a.f", "wrap", "demo", False, None)
    with pytest.raises(AttributeError):
        patch.applied = True
    text = repr(patch)
    assert "demo" in text and "wrap" in text and f"{name}.a.f" in text


# --- by-value copies -------------------------------------------------------------------------------


def test_by_value_copy_is_rebound_and_restored(fake):
    name, a, b = fake
    original = a.f
    assert b.f is original
    patch = Patch(f"{name}.a.f", add_ten, mode="wrap")
    patch.apply()
    assert b.f is a.f and b.call_f(1) == 12
    patch.revert()
    assert b.f is original and b.call_f(1) == 2


def test_copies_made_while_the_patch_is_active_are_restored_on_revert(fake, tmp_path):
    name, a, b = fake
    original = a.f
    (tmp_path / name / "late.py").write_text(f"from {name}.a import f\nfrom {name}.a import g as renamed\n")
    patch = Patch(f"{name}.a.f", add_ten, mode="wrap")
    created = Patch(f"{name}.a.g", lambda x: x, mode="replace", create=True)
    patch.apply()
    created.apply()
    late = importlib.import_module(f"{name}.late")  # imported while both patches are active
    assert late.f is a.f is not original and late.renamed is a.g
    created.revert()
    patch.revert()
    assert late.f is original and late.f(1) == 2 and b.f is original
    assert not hasattr(late, "renamed"), "a copy of a created attribute goes away with it"


def test_one_object_installed_on_two_targets_restores_each_copy_to_its_own_original(fake, tmp_path):
    name, a, _ = fake
    child, grandchild = a.Child, a.GrandChild
    (tmp_path / name / "late2.py").write_text(f"from {name}.a import Child, GrandChild\n")

    class Shared:
        pass

    patches = PatchSet("demo")
    patches.replace(f"{name}.a.Child", Shared)
    patches.replace(f"{name}.a.GrandChild", Shared)
    patches.apply()
    late = importlib.import_module(f"{name}.late2")
    assert late.Child is late.GrandChild is Shared
    patches.revert()  # one scan of sys.modules for the whole set
    assert late.Child is child and late.GrandChild is grandchild


def test_a_patch_set_scans_the_modules_once_and_rebinds_as_patch_by_patch(fake, tmp_path, monkeypatch):
    from mm_adaptor.core import module_scan

    name, a, b = fake
    (tmp_path / name / "c.py").write_text(f"from {name}.a import f, Child\nfrom {name}.a import f as alias\n")
    c = importlib.import_module(f"{name}.c")
    scans, real_scan = [], module_scan.holders
    monkeypatch.setattr(module_scan, "holders", lambda *args: scans.append(args) or real_scan(*args))
    other = type("Other", (), {})

    def make():  # the last wraps what the first rebound there
        return [Patch(f"{name}.a.f", add_ten, mode="wrap"), Patch(f"{name}.a.Child", other, mode="replace"),
                Patch(f"{name}.b.call_f", add_ten, mode="wrap"), Patch(f"{name}.c.alias", add_ten, mode="wrap")]

    def bindings(patches):
        label = {id(p._installed): i for i, p in enumerate(patches)}
        return {(m.__name__, attr): label.get(id(getattr(m, attr)), "original")
                for m in (a, b, c) for attr in ("f", "Child", "call_f", "alias") if hasattr(m, attr)}

    one_by_one = make()
    for patch in one_by_one:
        patch.apply()
    expected = bindings(one_by_one)
    assert len(scans) == 4 and c.alias(1) == 22
    for patch in reversed(one_by_one):
        patch.revert()
    scans.clear()
    patches = PatchSet("demo", make())
    patches.apply()
    # the last patch's original is the first one's wrapper, held where that patch put it (note_installed)
    assert len(scans) == 1, "one scan for the set"
    assert bindings(list(patches)) == expected
    assert expected[(c.__name__, "f")] == 0 and expected[(c.__name__, "Child")] == 1
    patches.revert()
    assert b.f is c.f is c.alias is a.f and c.alias(1) == 2 and c.Child is a.Child is not other


def test_sets_applied_together_scan_once_unless_a_module_under_the_prefixes_arrives_between(fake, tmp_path,
                                                                                           monkeypatch):
    """apply_all: one scan for the sets' originals; a module imported between the sets (it may hold a copy) makes
    the next patch scan again, and its copy is rebound as a scan of its own would."""
    from mm_adaptor.core import module_scan
    from mm_adaptor.core.patching import apply_all

    name, a, b = fake
    (tmp_path / name / "late.py").write_text(f"from {name}.b import call_f\n")
    scans, real_scan = [], module_scan.holders
    monkeypatch.setattr(module_scan, "holders", lambda *args: scans.append(args) or real_scan(*args))
    first = PatchSet("first", [Patch(f"{name}.a.f", add_ten, mode="wrap")])
    second = PatchSet("second", [Patch(f"{name}.b.call_f", add_ten, mode="wrap")])
    apply_all([first, second])
    assert len(scans) == 1 and b.f is a.f
    for patch_set in (second, first):
        patch_set.revert()
    scans.clear()
    original_call_f = b.call_f
    importer = PatchSet("importer", [Patch(f"{name}.a.f", add_ten, mode="wrap")])
    importer.apply = lambda scanned=None: (PatchSet.apply(importer, scanned=scanned),
                                           importlib.import_module(f"{name}.late"))
    apply_all([importer, second])
    late = sys.modules[f"{name}.late"]
    assert len(scans) == 2, "the module imported between the sets holds call_f: a scan of its own"
    assert late.call_f is b.call_f is not original_call_f
    second.revert()
    PatchSet.revert(importer)
    assert late.call_f is b.call_f is original_call_f


def test_copy_rebound_by_someone_else_is_left_alone(fake):
    name, a, b = fake
    original = a.f
    patch = Patch(f"{name}.a.f", add_ten, mode="wrap")
    patch.apply()
    mine = lambda x: 0  # noqa: E731
    b.f = mine
    patch.revert()
    assert a.f is original and b.f is mine


# --- apply / revert state ----------------------------------------------------------------------------


def test_double_apply_raises(fake):
    name, _, _ = fake
    patch = Patch(f"{name}.a.f", add_ten, mode="wrap")
    patch.apply()
    with pytest.raises(PatchError, match="already applied"):
        patch.apply()
    patch.revert()


def test_revert_without_apply_raises(fake):
    name, _, _ = fake
    with pytest.raises(PatchError, match="not applied"):
        Patch(f"{name}.a.f", add_ten, mode="wrap").revert()


def test_stacked_patches_must_be_reverted_lifo(fake):
    name, a, b = fake
    original = a.f
    first = Patch(f"{name}.a.f", add_ten, mode="wrap")
    second = Patch(f"{name}.a.f", lambda w, i, args, kw: w(*args, **kw) * 2, mode="wrap")
    first.apply()
    second.apply()
    assert a.f(1) == 24 and b.f(1) == 24
    assert active_patches()[-2:] == [first, second]
    with pytest.raises(PatchError, match="reverse order") as info:
        first.revert()
    assert f"{name}.a.f" in str(info.value) and first.applied
    second.revert()
    assert a.f(1) == 12 and b.f is a.f
    first.revert()
    assert a.f is original and b.f is original


def test_unresolvable_target_names_the_path(fake):
    name, _, _ = fake
    for target in ("no_such_module_qq.f", f"{name}.a.NoSuchClass.method", f"{name}.a.no_such_function"):
        with pytest.raises(PatchError, match=target.replace(".", r"\.")):
            Patch(target, add_ten, mode="wrap").apply()


def test_resolve_returns_module_or_class_owner(fake):
    name, a, _ = fake
    assert resolve(f"{name}.a.f") == (a, "f")
    assert resolve(f"{name}.a.Base.static") == (a.Base, "static")


# --- contracts -----------------------------------------------------------------------------------------


def test_version_mismatch_raises_with_details(fake):
    name, a, _ = fake
    version = installed_pytest()
    patch = Patch(f"{name}.a.f", add_ten, mode="wrap", feature="demo-feature",
                  contract=Contract(versions=f"<{version}", package="pytest"))
    with pytest.raises(PatchContractError) as info:
        patch.apply()
    message = str(info.value)
    for part in ("demo-feature", f"{name}.a.f", version, f"<{version}"):
        assert part in message
    assert message.endswith(f"set {ALLOW_MISMATCH_ENV}=1 to downgrade this to a warning")
    assert not patch.applied and a.f(1) == 2


def test_version_match_applies(fake):
    name, a, _ = fake
    patch = Patch(f"{name}.a.f", add_ten, mode="wrap",
                  contract=Contract(versions=f">={installed_pytest()}", package="pytest"))
    patch.apply()
    assert a.f(1) == 12
    patch.revert()


def test_missing_distribution_is_a_mismatch(fake):
    name, _, _ = fake
    patch = Patch(f"{name}.a.f", add_ten, mode="wrap",
                  contract=Contract(versions=">=0", package="mm-adaptor-no-such-dist"))
    with pytest.raises(PatchContractError, match="not installed"):
        patch.apply()


def test_fingerprint_match_applies_and_mismatch_raises(fake):
    name, a, _ = fake
    good = Patch(f"{name}.a.f", add_ten, mode="wrap",
                 contract=Contract(versions=">=0", package="pytest", fingerprint=fingerprint(a.f)))
    good.apply()
    good.revert()
    bad = Patch(f"{name}.a.f", add_ten, mode="wrap", feature="demo",
                contract=Contract(versions=">=0", package="pytest", fingerprint="0123456789abcdef"))
    with pytest.raises(PatchContractError) as info:
        bad.apply()
    message = str(info.value)
    assert f"the original's source changed (fingerprint {fingerprint(a.f)}, expected 0123456789abcdef)" in message
    assert installed_pytest() in message and "demo" in message


def test_env_var_downgrades_mismatch_to_warning(fake, monkeypatch):
    name, a, _ = fake
    for value in ("1", "true", "YES"):
        monkeypatch.setenv(ALLOW_MISMATCH_ENV, value)
        patch = Patch(f"{name}.a.f", add_ten, mode="wrap", contract=Contract(versions="<0.0.1", package="pytest"))
        with pytest.warns(PatchContractWarning, match="<0.0.1"):
            patch.apply()
        assert patch.applied and a.f(1) == 12
        patch.revert()
    monkeypatch.setenv(ALLOW_MISMATCH_ENV, "0")
    with pytest.raises(PatchContractError):
        Patch(f"{name}.a.f", add_ten, mode="wrap", contract=Contract(versions="<0.0.1", package="pytest")).apply()


def test_contract_on_static_method_checks_the_function(fake):
    name, a, _ = fake
    expected = fingerprint(a.Base.__dict__["static"].__func__)
    assert fingerprint(a.Base.__dict__["static"]) == expected
    patch = Patch(f"{name}.a.Base.static", add_ten, mode="wrap",
                  contract=Contract(versions=">=0", package="pytest", fingerprint=expected))
    patch.apply()
    patch.revert()


def test_fingerprint_unwraps_and_falls_back_to_signature(fake):
    _, a, _ = fake

    @functools.wraps(a.f)
    def decorated(*args, **kwargs):
        return a.f(*args, **kwargs)

    assert fingerprint(decorated) == fingerprint(a.f)
    assert len(fingerprint(a.f)) == 16 and int(fingerprint(a.f), 16) >= 0
    namespace = {}
    exec("def g(p, q=2):\n    return p", namespace)  # no source file
    assert fingerprint(namespace["g"]) == fingerprint(eval("lambda p, q=2: p"))  # both hash "sig:(p, q=2)"


# --- descriptors and inheritance ----------------------------------------------------------------------


def test_static_and_class_method_wraps_keep_working(fake):
    name, a, _ = fake
    patches = PatchSet("demo")
    patches.wrap(f"{name}.a.Base.static", add_ten)
    patches.wrap(f"{name}.a.Base.make", lambda w, i, args, kw: ("wrapped",) + w(*args, **kw))
    raw_static, raw_make = a.Base.__dict__["static"], a.Base.__dict__["make"]
    patches.apply()
    try:
        assert isinstance(a.Base.__dict__["static"], staticmethod)
        assert isinstance(a.Base.__dict__["make"], classmethod)
        assert a.Base.static(5) == 14 and a.Base().static(5) == 14
        assert a.Base.make(1) == ("wrapped", "Base", 1)
        assert a.Child().make(2) == ("wrapped", "Child", 2)
    finally:
        patches.revert()
    assert a.Base.__dict__["static"] is raw_static and a.Base.__dict__["make"] is raw_make


def test_inherited_method_patched_on_subclass_is_removed_on_revert(fake):
    name, a, _ = fake
    patch = Patch(f"{name}.a.Child.method", add_ten, mode="wrap")
    patch.apply()
    assert "method" in a.Child.__dict__
    assert a.Child().method(1) == 12 and a.GrandChild().method(1) == 12 and a.Base().method(1) == 2
    patch.revert()
    assert "method" not in a.Child.__dict__ and a.Child().method(1) == 2


def test_inherited_classmethod_keeps_binding_to_the_calling_class(fake):
    name, a, _ = fake
    patch = Patch(f"{name}.a.Child.make", lambda w, i, args, kw: w(*args, **kw), mode="wrap")
    patch.apply()
    try:
        assert isinstance(a.Child.__dict__["make"], classmethod)
        assert a.GrandChild.make(3) == ("GrandChild", 3)
    finally:
        patch.revert()
    assert "make" not in a.Child.__dict__


def test_property_is_replaced_and_restored_exactly(fake):
    name, a, _ = fake
    raw = a.Base.__dict__["value"]
    patch = Patch(f"{name}.a.Base.value", property(lambda self: 99), mode="replace")
    patch.apply()
    assert a.Base().value == 99 and patch.original is raw
    patch.revert()
    assert a.Base.__dict__["value"] is raw and a.Base().value == 10


def test_wrapping_a_non_callable_is_refused(fake):
    name, a, _ = fake
    with pytest.raises(PatchError, match="replace"):
        Patch(f"{name}.a.Base.value", add_ten, mode="wrap").apply()
    assert a.Base().value == 10


def test_create_adds_and_revert_removes_a_missing_attribute(fake):
    name, a, _ = fake
    patch = Patch(f"{name}.a.NEW_NAME", None, mode="replace", create=True)
    patch.apply()
    assert hasattr(a, "NEW_NAME")
    patch.revert()
    assert not hasattr(a, "NEW_NAME")


def test_replacing_a_value_does_not_rebind_unrelated_equal_values(fake):
    name, a, b = fake
    a.FLAG = False
    b.OTHER_FLAG = False  # an unrelated global that happens to be the same singleton
    patch = Patch(f"{name}.a.FLAG", True, mode="replace")
    patch.apply()
    try:
        assert a.FLAG is True and b.OTHER_FLAG is False
    finally:
        patch.revert()
    assert a.FLAG is False


def test_module_patch_provides_and_removes_a_module():
    import types

    from mm_adaptor.core.patching import ModulePatch

    shim = types.ModuleType("mm_test_shim_module")
    patch = ModulePatch("mm_test_shim_module", shim)
    patch.apply()
    import mm_test_shim_module

    assert mm_test_shim_module is shim
    patch.revert()
    assert "mm_test_shim_module" not in sys.modules


# --- PatchSet ------------------------------------------------------------------------------------------


def test_patch_set_is_all_or_nothing(fake):
    name, a, b = fake
    original = a.f
    patches = PatchSet("demo")
    first = patches.wrap(f"{name}.a.f", add_ten)
    patches.replace(f"{name}.a.missing_module_attr.x", lambda: None)
    with pytest.raises(PatchError, match="missing_module_attr"):
        patches.apply()
    assert not first.applied and not patches.applied
    assert a.f is original and b.f is original


def test_patch_set_helpers_and_order(fake):
    name, a, _ = fake
    patches = PatchSet("feat", [Patch(f"{name}.a.f", add_ten, mode="wrap", feature="feat")])
    patches.replace(f"{name}.a.Base.method", lambda self, x: -x)
    patches.add(Patch(f"{name}.a.f", add_ten, mode="wrap", feature="feat"))
    assert len(patches) == 3
    assert patches.targets() == [f"{name}.a.f", f"{name}.a.Base.method", f"{name}.a.f"]
    assert all(p.feature == "feat" for p in patches)
    assert [p.mode for p in patches] == ["wrap", "replace", "wrap"]
    patches.apply()
    assert patches.applied and a.f(1) == 22 and a.Base().method(3) == -3
    patches.revert()
    assert not patches.applied and a.f(1) == 2 and a.Base().method(3) == 6
    patches.revert()  # reverting again skips what is not applied


# --- real megatron-core ----------------------------------------------------------------------------------


def test_megatron_divide_copies_are_rebound_and_restored(monkeypatch):
    import megatron.core.tensor_parallel  # noqa: F401  (imports layers, which copy divide too)
    import megatron.core.tensor_parallel.utils as tp_utils
    import megatron.core.utils as core_utils

    original = core_utils.divide
    assert tp_utils.divide is original  # `from megatron.core.utils import divide`
    holders = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("megatron") and m.__dict__.get("divide") is original]
    assert {core_utils, tp_utils} <= set(holders)

    calls = []

    def count(wrapped, instance, args, kwargs):
        calls.append(args)
        return wrapped(*args, **kwargs)

    version = importlib.metadata.version("megatron-core")
    monkeypatch.setitem(contracts.VERIFIED_ON, "demo", (version,))  # no table lists divide: verified here, as pinned
    patch = Patch("megatron.core.tensor_parallel.utils.divide", count, mode="wrap", feature="demo",
                  contract=Contract(versions=f"=={version}", fingerprint=fingerprint(original)))
    patch.apply()
    try:
        installed = tp_utils.divide
        assert installed is not original and all(m.divide is installed for m in holders)
        assert core_utils.divide(8, 2) == 4 and calls == [(8, 2)]
        with pytest.raises(AssertionError):
            core_utils.divide(7, 2)
    finally:
        patch.revert()
    assert all(m.divide is original for m in holders)


def test_megatron_module_imported_while_fused_rope_is_on_keeps_nothing_fused_after_disable():
    """megatron.core.transformer.attention copies apply_rotary_pos_emb by value; imported while
    --use-fused-rotary-pos-emb is active, its copy is the patched function until disable()."""
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401  (attention and everything it imports)
    import megatron.core.transformer as transformer_package
    from megatron.core.models.common.embeddings import rope_utils

    import mm_adaptor

    name = "megatron.core.transformer.attention"
    original = rope_utils.apply_rotary_pos_emb
    imported_before = sys.modules[name]
    assert imported_before.apply_rotary_pos_emb is original
    mm_adaptor.enable({"use_fused_rotary_pos_emb": True, "position_embedding_type": "rope"})
    try:
        assert imported_before.apply_rotary_pos_emb is rope_utils.apply_rotary_pos_emb is not original
        del sys.modules[name]
        imported_during = importlib.import_module(name)
        assert imported_during is not imported_before
        assert imported_during.apply_rotary_pos_emb is rope_utils.apply_rotary_pos_emb is not original
    finally:
        mm_adaptor.disable()
        sys.modules[name] = imported_before
        transformer_package.attention = imported_before
    assert rope_utils.apply_rotary_pos_emb is original
    assert imported_during.apply_rotary_pos_emb is original
    holders = [(module_name, attr) for module_name, module in list(sys.modules.items())
               if module_name.startswith("megatron") and module is not None
               for attr, value in vars(module).items()
               if getattr(value, "__name__", None) == "apply_rotary_pos_emb" and value is not original]
    assert not holders, f"still patched after disable: {holders}"


def _build(self, kind):
    return kind


class _FingerprintBase:
    # inherited, a descriptor: getattr on the subclass decodes it into functools' own unbound method
    build = __import__("functools").partialmethod(_build, "tiny")


class _FingerprintChild(_FingerprintBase):
    pass


def test_the_fingerprint_command_reads_the_target_as_a_contract_does(capsys):
    """`mm-adaptor fingerprint` resolves its target through Patch._raw_attribute, as a contract's check does."""
    from mm_adaptor.cli import fingerprint_main
    from mm_adaptor.core.patching import Patch

    raw, _ = Patch._raw_attribute(_FingerprintChild, "build")
    assert raw is _FingerprintBase.__dict__["build"]
    assert fingerprint(_FingerprintChild.build) != fingerprint(raw), "the case no longer tells them apart"
    assert fingerprint_main([f"{__name__}._FingerprintChild.build"]) == 0
    assert capsys.readouterr().out.split() == [f"{__name__}._FingerprintChild.build", fingerprint(raw)]
