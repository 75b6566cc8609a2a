"""Feature registry, flag registration (including attaching to flags a parser already owns), validation,
and the enable / applied / disable lifecycle."""

import argparse
import sys
import types

import pytest

import mm_adaptor
from mm_adaptor.core import features
from mm_adaptor.core.features import Feature, FeatureConfigError, Flag, register, unregister
from mm_adaptor.core.patching import PatchSet


@pytest.fixture
def target_module(monkeypatch):
    module = types.ModuleType("mm_fake_target")
    module.compute = lambda x: x + 1
    monkeypatch.setitem(sys.modules, "mm_fake_target", module)
    return module


@pytest.fixture
def demo_features(target_module):
    @register
    class Doubler(Feature):
        name = "test-doubler"
        description = "doubles compute's result"
        flags = (Flag("--use-test-doubler", "turn on"), Flag("--test-doubler-factor", "factor", type=int, default=2))

        def patch_sets(self, options):
            factor = options.test_doubler_factor
            ps = PatchSet(self.name)
            ps.wrap("mm_fake_target.compute", lambda wrapped, inst, args, kw: wrapped(*args, **kw) * factor)
            return [ps]

    @register
    class NeedsDoubler(Feature):
        name = "test-needs-doubler"
        description = "requires the doubler"
        flags = (Flag("--use-test-needs-doubler", "turn on"),)
        requires = ("test-doubler",)

        def patch_sets(self, options):
            return []

    @register
    class Clashes(Feature):
        name = "test-clashes"
        description = "conflicts with the doubler"
        flags = (Flag("--use-test-clashes", "turn on"),)
        conflicts = ("test-doubler",)

        def patch_sets(self, options):
            return []

    @register
    class Broken(Feature):
        name = "test-broken"
        description = "its patch target does not exist"
        flags = (Flag("--test-owned-flag", "a flag the host parser owns", megatron_owned=True),)

        def validate(self, options):
            if getattr(options, "seq_length", 0) == 3:
                raise FeatureConfigError("--test-owned-flag needs --seq-length != 3: change --seq-length")

        def patch_sets(self, options):
            ps = PatchSet(self.name)
            ps.replace("mm_fake_target.does_not_exist", None)
            return [ps]

    yield
    mm_adaptor.disable()
    for name in ("test-doubler", "test-needs-doubler", "test-clashes", "test-broken"):
        unregister(name)


def test_flags_are_added_and_parsed(demo_features):
    parser = features.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--use-test-doubler", "--test-doubler-factor", "3"])
    assert args.use_test_doubler is True and args.test_doubler_factor == 3
    assert args.use_test_clashes is False


def test_flag_already_owned_by_the_parser_is_attached_not_added(demo_features):
    parser = argparse.ArgumentParser()
    parser.add_argument("--test-owned-flag", action="store_true", help="the host parser's own")
    features.add_arguments(parser)  # adding it twice would raise argparse.ArgumentError
    assert parser.parse_args(["--test-owned-flag"]).test_owned_flag is True


def test_off_applies_nothing(demo_features, target_module):
    mm_adaptor.enable(argparse.Namespace())
    assert mm_adaptor.applied_features() == {}
    assert target_module.compute(1) == 2


def test_enable_applied_disable(demo_features, target_module):
    original = target_module.compute
    active = mm_adaptor.enable(use_test_doubler=True, test_doubler_factor=5)
    assert mm_adaptor.applied_features() == {"test-doubler": ["mm_fake_target.compute"]}
    assert mm_adaptor.applied() == active
    backend = mm_adaptor.devices.current()
    assert list(active) == ["test-doubler", f"backend:{backend.name}"]  # the device backend's patches, listed too
    assert active[f"backend:{backend.name}"] == backend.applied_targets()
    assert target_module.compute(1) == 10
    mm_adaptor.disable()
    assert target_module.compute is original
    assert mm_adaptor.applied() == {}


def test_enable_twice_same_options_is_noop_and_different_is_an_error(demo_features):
    mm_adaptor.enable(use_test_doubler=True)
    assert mm_adaptor.enable(use_test_doubler=True)["test-doubler"] == ["mm_fake_target.compute"]
    with pytest.raises(FeatureConfigError, match="already enabled"):
        mm_adaptor.enable(use_test_doubler=True, test_doubler_factor=7)


def test_requires_names_both_flags(demo_features):
    with pytest.raises(FeatureConfigError, match="--use-test-needs-doubler requires --use-test-doubler"):
        mm_adaptor.enable(use_test_needs_doubler=True)


def test_conflict_names_both_flags(demo_features):
    with pytest.raises(FeatureConfigError, match="--use-test-clashes cannot be combined with --use-test-doubler"):
        mm_adaptor.enable(use_test_clashes=True, use_test_doubler=True)


def test_feature_validation_error(demo_features):
    with pytest.raises(FeatureConfigError, match="--seq-length"):
        mm_adaptor.enable(argparse.Namespace(seq_length=3, test_owned_flag=True))


def test_unknown_keyword_is_rejected(demo_features):
    with pytest.raises(FeatureConfigError, match="unknown feature option"):
        mm_adaptor.enable(use_test_dubler=True)


def test_failure_leaves_nothing_half_applied(demo_features, target_module):
    original = target_module.compute
    with pytest.raises(Exception, match="does_not_exist"):
        mm_adaptor.enable(use_test_doubler=True, test_owned_flag=True)
    assert target_module.compute is original
    assert mm_adaptor.applied_features() == {}


def test_flag_taken_by_two_features_is_refused(demo_features):
    class Thief(Feature):
        name = "test-thief"
        flags = (Flag("--use-test-doubler", "stolen"),)

    with pytest.raises(TypeError, match="already belongs to 'test-doubler'"):
        register(Thief)


def test_one_supported_megatron_core_range_matches_the_package_dependency():
    import pathlib
    import tomllib

    from mm_adaptor.core.patching import SUPPORTED_MEGATRON_CORE

    project = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert f"megatron-core{SUPPORTED_MEGATRON_CORE}" in project["dependencies"]
