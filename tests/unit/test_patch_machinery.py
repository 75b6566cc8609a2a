"""Patch apply/revert, explicit modes, contracts, by-value copy rebinding, descriptors, PatchSet atomicity."""

import inspect
import sys
import textwrap
import uuid

import pytest

from mm_adaptor.patching import (
    ALLOW_MISMATCH_ENV, Contract, Patch, PatchContractError, PatchContractWarning, PatchError, PatchSet,
    active_patches, fingerprint,
)


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    name = f"fakepkg_{uuid.uuid4().hex[:8]}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text(textwrap.dedent('''
        def f(x, *, scale=1):
            return (x + 1) * scale

        class Base:
            def method(self, x):
                return x * 2

            @staticmethod
            def static(x):
                return x - 1

            @classmethod
            def cls_method(cls, x):
                return (cls.__name__, x)

        class Child(Base):
            pass
    '''))
    (root / "b.py").write_text(f"from {name}.a import f\n\ndef use(x):\n    return f(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    a = importlib.import_module(f"{name}.a")
    b = importlib.import_module(f"{name}.b")
    yield name, a, b
    for mod in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[mod]


def double(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) * 2


def test_replace_apply_revert_restores_identity(pkg):
    name, a, b = pkg
    original = a.f
    patch = Patch(f"{name}.a.f", lambda x, *, scale=1: 42, mode="replace", feature="demo")
    patch.apply()
    assert a.f(1) == 42 and patch.applied and patch in active_patches()
    patch.revert()
    assert a.f is original and not patch.applied and patch not in active_patches()


def test_by_value_copy_is_rebound_and_restored(pkg):
    name, a, b = pkg
    original = b.f
    patch = Patch(f"{name}.a.f", double, mode="wrap")
    patch.apply()
    assert b.f is a.f and b.use(1) == 4
    patch.revert()
    assert b.f is original and b.use(1) == 2


def test_wrap_preserves_signature(pkg):
    name, a, _ = pkg
    before = inspect.signature(a.f)
    patch = Patch(f"{name}.a.f", double, mode="wrap")
    patch.apply()
    try:
        assert inspect.signature(a.f) == before
        assert a.f(1, scale=3) == 12
    finally:
        patch.revert()


def test_mode_must_be_explicit():
    with pytest.raises(ValueError, match="replace"):
        Patch("x.y", double, mode="wrapper")


def test_double_apply_and_revert_without_apply(pkg):
    name, _, _ = pkg
    patch = Patch(f"{name}.a.f", double, mode="wrap")
    with pytest.raises(PatchError, match="not applied"):
        patch.revert()
    patch.apply()
    with pytest.raises(PatchError, match="already applied"):
        patch.apply()
    patch.revert()


def test_stacked_patches_revert_in_reverse_order_only(pkg):
    name, a, _ = pkg
    original = a.f
    first, second = Patch(f"{name}.a.f", double, mode="wrap"), Patch(f"{name}.a.f", double, mode="wrap")
    first.apply()
    second.apply()
    assert a.f(1) == 8
    with pytest.raises(PatchError, match="reverse order"):
        first.revert()
    second.revert()
    first.revert()
    assert a.f is original


def test_version_mismatch_names_feature_target_and_versions(pkg):
    name, a, _ = pkg
    patch = Patch(f"{name}.a.f", double, mode="wrap", feature="demo",
                  contract=Contract(versions="<1", package="pytest"))
    with pytest.raises(PatchContractError) as info:
        patch.apply()
    message = str(info.value)
    assert "'demo'" in message and f"{name}.a.f" in message and "pytest <1" in message
    assert ALLOW_MISMATCH_ENV in message
    assert not patch.applied and a.f(1) == 2


def test_missing_package_is_a_mismatch(pkg):
    name, _, _ = pkg
    patch = Patch(f"{name}.a.f", double, mode="wrap", contract=Contract(versions=">=1", package="no-such-dist-xyz"))
    with pytest.raises(PatchContractError, match="no-such-dist-xyz is not installed"):
        patch.apply()


def test_fingerprint_match_and_mismatch(pkg):
    name, a, _ = pkg
    good = Patch(f"{name}.a.f", double, mode="wrap", contract=Contract(versions=">=1", package="pytest",
                                                                         fingerprint=fingerprint(a.f)))
    good.apply()
    good.revert()
    bad = Patch(f"{name}.a.f", double, mode="wrap", contract=Contract(versions=">=1", package="pytest",
                                                                        fingerprint="0" * 16))
    with pytest.raises(PatchContractError, match="source changed"):
        bad.apply()


def test_env_var_downgrades_mismatch_to_warning(pkg, monkeypatch):
    name, a, _ = pkg
    monkeypatch.setenv(ALLOW_MISMATCH_ENV, "1")
    patch = Patch(f"{name}.a.f", double, mode="wrap", contract=Contract(versions="<1", package="pytest"))
    with pytest.warns(PatchContractWarning, match="pytest <1"):
        patch.apply()
    assert a.f(1) == 4
    patch.revert()


def test_static_and_class_methods_keep_their_descriptors(pkg):
    name, a, _ = pkg
    patches = PatchSet("demo")
    patches.wrap(f"{name}.a.Base.static", double)
    patches.wrap(f"{name}.a.Base.cls_method", lambda w, i, args, kw: ("wrapped", w(*args, **kw)))
    patches.apply()
    try:
        assert a.Base.static(5) == 8 and a.Base().static(5) == 8
        assert a.Child.cls_method(1) == ("wrapped", ("Child", 1))
        assert isinstance(a.Base.__dict__["static"], staticmethod)
    finally:
        patches.revert()
    assert a.Base.static(5) == 4


def test_inherited_method_patched_on_subclass_is_removed_on_revert(pkg):
    name, a, _ = pkg
    patch = Patch(f"{name}.a.Child.method", double, mode="wrap")
    patch.apply()
    assert a.Child().method(1) == 4 and a.Base().method(1) == 2
    patch.revert()
    assert "method" not in a.Child.__dict__


def test_patch_set_is_all_or_nothing(pkg):
    name, a, _ = pkg
    original = a.f
    patches = PatchSet("demo")
    patches.wrap(f"{name}.a.f", double)
    patches.wrap(f"{name}.a.does_not_exist", double)
    with pytest.raises(PatchError, match="does_not_exist"):
        patches.apply()
    assert a.f is original and not patches.applied


def test_create_adds_and_revert_removes_a_missing_attribute(pkg):
    name, a, _ = pkg
    patch = Patch(f"{name}.a.NEW_NAME", None, mode="replace", create=True)
    patch.apply()
    assert hasattr(a, "NEW_NAME")
    patch.revert()
    assert not hasattr(a, "NEW_NAME")


def test_unresolvable_target_names_the_path():
    with pytest.raises(PatchError, match="no_such_module_xyz.f"):
        Patch("no_such_module_xyz.f", double, mode="wrap").apply()


def test_real_megatron_copies_are_rebound():
    import megatron.core.tensor_parallel.utils as tp_utils
    from megatron.core import utils as core_utils

    holders = [m for m in list(sys.modules.values()) if m is not None and m.__name__.startswith("megatron")
               and getattr(m, "divide", None) is core_utils.divide]
    assert len(holders) >= 2, "megatron imports divide by value into several modules"
    original = core_utils.divide
    patch = Patch("megatron.core.utils.divide", double, mode="wrap")
    patch.apply()
    try:
        assert all(m.divide is core_utils.divide for m in holders)
        assert tp_utils.divide(8, 2) == 8
    finally:
        patch.revert()
    assert all(m.divide is original for m in holders)


def test_replacing_a_value_does_not_rebind_unrelated_equal_values(pkg):
    name, a, b = pkg
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

    from mm_adaptor.patching import ModulePatch

    shim = types.ModuleType("mm_test_shim_module")
    patch = ModulePatch("mm_test_shim_module", shim)
    patch.apply()
    import mm_test_shim_module

    assert mm_test_shim_module is shim
    patch.revert()
    assert "mm_test_shim_module" not in sys.modules
