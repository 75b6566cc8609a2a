"""enable / applied / disable: the programmatic entry points."""

from __future__ import annotations

import argparse
import threading
from typing import Any

from mm_adaptor import devices

from mm_adaptor.core import features
from mm_adaptor.core.features import AppliedFeature, FeatureConfigError

_lock = threading.RLock()
_applied: list[AppliedFeature] = []


def _as_options(args, keywords: dict[str, Any]) -> argparse.Namespace:
    if args is None:
        options = argparse.Namespace()
    elif isinstance(args, argparse.Namespace):
        options = args
    elif isinstance(args, dict):
        options = argparse.Namespace(**args)
    else:
        options = args  # any attribute bag (e.g. Megatron's args object)
    known = {flag.dest for _, flag in features.all_flags()}
    unknown = sorted(set(keywords) - known)
    if unknown:
        raise FeatureConfigError(
            f"unknown feature option(s) {', '.join(unknown)}; known options: {', '.join(sorted(known)) or 'none'}"
        )
    for key, value in keywords.items():
        setattr(options, key, value)
    return features.fill_defaults(options)


def enable(args=None, /, *, device: str | None = None, **keywords) -> dict[str, list[str]]:
    """Validate and apply the features switched on in `args` (a namespace or dict) and/or keywords.

    Installs the device backend first if none is installed. All or nothing: on any error nothing
    stays applied. Calling it again with the same options is a no-op; with different options it is
    an error (call disable() first).
    """
    with _lock:
        options = _as_options(args, keywords)
        wanted = features.serving(options, features.enabled_features(options))
        if _applied:
            same = [(a.feature.name, a.options) for a in _applied] == [
                (f.name, f.options_of(options)) for f in wanted
            ]
            if same:
                return applied()
            raise FeatureConfigError(
                "mm_adaptor is already enabled with "
                f"{', '.join(a.feature.main_flag.option for a in _applied) or 'no features'}; "
                "call mm_adaptor.disable() before enabling a different set"
            )
        features.validate(options, wanted)
        if devices.current() is None:
            devices.install(device)
        done: list[AppliedFeature] = []
        try:
            for feature in wanted:
                record = AppliedFeature(feature, feature.options_of(options))
                done.append(record)
                for patch_set in feature.patch_sets(options):
                    patch_set.apply()
                    record.patch_sets.append(patch_set)
        except BaseException:
            _revert_records(done)
            raise
        _applied.extend(done)
        return applied()


def _revert_records(records: list[AppliedFeature]) -> None:
    for record in reversed(records):
        for patch_set in reversed(record.patch_sets):
            patch_set.revert()
        record.patch_sets.clear()


def applied_features() -> dict[str, list[str]]:
    """Active features and the dotted targets each one patched (no device backend entry)."""
    with _lock:
        return {record.feature.name: record.targets() for record in _applied}


def feature_statistics() -> dict[str, dict]:
    """What each active feature that keeps statistics has done so far (Feature.statistics)."""
    with _lock:
        records = list(_applied)
    stats = {record.feature.name: record.feature.statistics() for record in records}
    return {name: value for name, value in stats.items() if value is not None}


def patch_calls() -> dict[str, dict[str, int | None]]:
    """Per active feature, how often each of its installed functions ran (None: a replaced class or value)."""
    with _lock:
        return {record.feature.name: {patch.target: patch.calls for ps in record.patch_sets for patch in ps
                                      if hasattr(patch, "calls")} for record in _applied}


def applied() -> dict[str, list[str]]:
    """Everything patched now: applied_features(), then the installed device backend's device and
    compatibility patches under 'backend:<name>'."""
    with _lock:
        active = applied_features()
        backend = devices.current()
        if backend is not None:
            active[f"backend:{backend.name}"] = backend.applied_targets()
        return active


def disable(*, keep_device: bool = False) -> None:
    """Revert every applied feature and, unless keep_device, the device backend."""
    with _lock:
        _revert_records(_applied)
        _applied.clear()
        if not keep_device:
            devices.uninstall()
