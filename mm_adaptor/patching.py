"""Versioned, reversible patches of dotted targets.

A Patch says explicitly whether it replaces or wraps its target, carries a Contract (supported
versions + fingerprint of the original), rebinds by-value copies of the original in other
imported modules, and reverts all of it exactly.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import os
import sys
import textwrap
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import wrapt
from packaging.specifiers import SpecifierSet

ALLOW_MISMATCH_ENV = "MM_ADAPTOR_ALLOW_CONTRACT_MISMATCH"
# The megatron-core releases every patch is written for (pyproject.toml's dependency says the same; a test checks).
SUPPORTED_MEGATRON_CORE = ">=0.16.0,<0.17"
MODES = ("replace", "wrap")
_MISSING = object()


class PatchError(RuntimeError):
    pass


class PatchContractError(PatchError):
    pass


class PatchContractWarning(UserWarning):
    pass


def _mismatch_allowed() -> bool:
    return os.environ.get(ALLOW_MISMATCH_ENV, "").strip().lower() in ("1", "true", "yes")


def _underlying(obj):
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    elif isinstance(obj, property) and obj.fget is not None:
        obj = obj.fget
    try:
        return inspect.unwrap(obj)
    except ValueError:
        return obj


def fingerprint(obj) -> str:
    """16 hex digits identifying the source of obj (or its signature when no source exists)."""
    target = _underlying(obj)
    if isinstance(target, wrapt.ObjectProxy):
        target = target.__wrapped__
    try:
        source = textwrap.dedent(inspect.getsource(target))
        text = "\n".join(line.rstrip() for line in source.splitlines())
    except (OSError, TypeError):
        try:
            text = "sig:" + str(inspect.signature(target))
        except (TypeError, ValueError):
            text = "repr:" + repr(target)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Contract:
    """The versions of `package` a patch was written for, and optionally the original's fingerprint."""

    versions: str
    fingerprint: str | None = None
    package: str = "megatron-core"

    def check(self, original, *, feature: str, target: str) -> None:
        try:
            installed = importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        problems = []
        if installed is None:
            problems.append(f"{self.package} is not installed")
        elif not SpecifierSet(self.versions).contains(installed, prereleases=True):
            problems.append(f"{self.package} {installed} is installed, outside the supported versions")
        if self.fingerprint is not None:
            actual = fingerprint(original)
            if actual != self.fingerprint:
                problems.append(f"the original's source changed (fingerprint {actual}, expected {self.fingerprint})")
        if not problems:
            return
        found = f"{self.package} {installed}" if installed else f"{self.package} (not installed)"
        message = (
            f"feature {feature or '?'!r} cannot patch {target}: {'; '.join(problems)}; "
            f"installed: {found}; this patch supports {self.package} {self.versions}; "
            f"set {ALLOW_MISMATCH_ENV}=1 to downgrade this to a warning"
        )
        if _mismatch_allowed():
            warnings.warn(message, PatchContractWarning, stacklevel=4)
            return
        raise PatchContractError(message)


def resolve(dotted: str) -> tuple[Any, str]:
    """(owner, attribute name) for a dotted path: the longest importable module, then attributes."""
    parts = dotted.split(".")
    if len(parts) < 2:
        raise PatchError(f"cannot resolve {dotted!r}: a target needs a module and an attribute")
    module = None
    index = len(parts) - 1
    while index > 0:
        name = ".".join(parts[:index])
        try:
            module = importlib.import_module(name)
            break
        except ModuleNotFoundError as exc:
            if exc.name and not name.startswith(exc.name) and exc.name != name:
                raise PatchError(f"cannot resolve {dotted!r}: importing {name} failed: {exc}") from exc
            index -= 1
    if module is None:
        raise PatchError(f"cannot resolve {dotted!r}: no importable module in the path")
    owner = module
    for attr in parts[index:-1]:
        try:
            owner = getattr(owner, attr)
        except AttributeError:
            raise PatchError(f"cannot resolve {dotted!r}: {owner!r} has no attribute {attr!r}") from None
    return owner, parts[-1]


_ACTIVE: list["Patch"] = []


def _has_identity(obj) -> bool:
    """Only functions, classes and other callables are copied by `from x import f` in a way worth following;
    values such as False, None, 0 or interned strings are shared by unrelated names and must not be rebound."""
    return callable(obj) and not isinstance(obj, (bool, int, float, str, bytes))


def active_patches() -> list["Patch"]:
    return list(_ACTIVE)


class Patch:
    """Replace or wrap one dotted target. `new` is the replacement, or a wrapt wrapper(wrapped, instance, args, kwargs)."""

    rebind_prefixes: tuple[str, ...] = ("megatron",)

    def __init__(self, target: str, new, *, mode: str, contract: Contract | None = None, feature: str = "",
                 create: bool = False):
        if mode not in MODES:
            raise ValueError(f"patch mode must be one of {MODES}, got {mode!r}")
        self._target = target
        self.new = new
        self._mode = mode
        self.contract = contract
        self._feature = feature
        self.create = create
        self._applied = False
        self._original = None
        self._owner = None
        self._name = ""
        self._was_own = False
        self._installed = None
        self._copies: list[tuple[Any, str]] = []

    @property
    def target(self) -> str:
        return self._target

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def feature(self) -> str:
        return self._feature

    @property
    def applied(self) -> bool:
        return self._applied

    @property
    def original(self):
        """The raw attribute the patch replaced (a staticmethod/classmethod/property stays one)."""
        return self._original

    def __repr__(self) -> str:
        state = "applied" if self.applied else "not applied"
        return f"<Patch {self.feature or '-'}: {self.mode} {self.target} ({state})>"

    def _build(self, original):
        if self.mode == "replace":
            return self.new
        if isinstance(original, (staticmethod, classmethod)):
            return type(original)(wrapt.FunctionWrapper(original.__func__, self.new))
        if not callable(original):
            raise PatchError(
                f"cannot wrap {self.target}: {type(original).__name__} is not callable; use mode='replace'"
            )
        return wrapt.FunctionWrapper(original, self.new)

    @staticmethod
    def _raw_attribute(owner, name):
        """(raw attribute, whether owner defines it itself); class descriptors come from the MRO undecoded."""
        if not isinstance(owner, type):
            return getattr(owner, name, _MISSING), True
        if name in owner.__dict__:
            return owner.__dict__[name], True
        for klass in owner.__mro__[1:]:
            if name in klass.__dict__:
                return klass.__dict__[name], False
        return getattr(owner, name, _MISSING), False

    def apply(self) -> None:
        if self.applied:
            raise PatchError(f"{self!r} is already applied")
        owner, name = resolve(self.target)
        original, own = self._raw_attribute(owner, name)
        if original is _MISSING:
            if not self.create:
                raise PatchError(f"cannot resolve {self.target!r}: {owner!r} has no attribute {name!r}")
            if self.mode == "wrap":
                raise PatchError(f"cannot wrap {self.target!r}: it does not exist")
            own = False
        elif self.contract is not None:
            self.contract.check(original, feature=self.feature, target=self.target)
        installed = self._build(original)
        setattr(owner, name, installed)
        self._owner, self._name, self._was_own = owner, name, own
        self._original, self._installed = original, installed
        self._copies = []
        if original is not _MISSING and not isinstance(owner, type) and _has_identity(original):
            self._rebind_copies(owner, original, installed)
        self._applied = True
        _ACTIVE.append(self)

    def _rebind_copies(self, owner, original, installed) -> None:
        root = getattr(owner, "__name__", "").split(".")[0]
        prefixes = tuple({*self.rebind_prefixes, root} - {""})
        for mod_name, module in list(sys.modules.items()):
            if module is None or module is owner or not mod_name.startswith(prefixes):
                continue
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                if value is original:
                    setattr(module, attr, installed)
                    self._copies.append((module, attr))

    def revert(self) -> None:
        if not self.applied:
            raise PatchError(f"{self!r} is not applied")
        owner, name = self._owner, self._name
        current = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        if current is not self._installed:
            raise PatchError(
                f"cannot revert {self.target}: another patch was applied on top of it; "
                "patches of one target must be reverted in reverse order of applying"
            )
        if self._was_own and self._original is not _MISSING:
            setattr(owner, name, self._original)
        else:
            delattr(owner, name)
        for module, attr in self._copies:
            if module.__dict__.get(attr) is self._installed:
                setattr(module, attr, self._original)
        self._copies = []
        self._applied = False
        self._installed = None
        if self in _ACTIVE:
            _ACTIVE.remove(self)


class ModulePatch:
    """Makes `import name` give `module` (an API-compatible implementation), and reverts exactly."""

    def __init__(self, name: str, module, *, feature: str = ""):
        self.target = f"sys.modules[{name!r}]"
        self.name, self.module, self.feature = name, module, feature
        self.applied = False
        self._previous = _MISSING

    def apply(self) -> None:
        if self.applied:
            raise PatchError(f"{self.target} is already applied")
        self._previous = sys.modules.get(self.name, _MISSING)
        sys.modules[self.name] = self.module
        self.applied = True
        _ACTIVE.append(self)

    def revert(self) -> None:
        if not self.applied:
            raise PatchError(f"{self.target} is not applied")
        if self._previous is _MISSING:
            sys.modules.pop(self.name, None)
        else:
            sys.modules[self.name] = self._previous
        self.applied = False
        _ACTIVE.remove(self)


class PatchSet:
    """Ordered patches applied all-or-nothing and reverted in reverse order."""

    def __init__(self, name: str, patches: Iterable[Patch] = ()):
        self.name = name
        self._patches: list[Patch] = list(patches)

    def add(self, patch: "Patch | ModulePatch") -> "Patch | ModulePatch":
        self._patches.append(patch)
        return patch

    def replace(self, target: str, new, contract: Contract | None = None, *, create: bool = False) -> Patch:
        return self.add(Patch(target, new, mode="replace", contract=contract, feature=self.name, create=create))

    def wrap(self, target: str, wrapper: Callable, contract: Contract | None = None) -> Patch:
        return self.add(Patch(target, wrapper, mode="wrap", contract=contract, feature=self.name))

    def provide_module(self, name: str, module) -> ModulePatch:
        return self.add(ModulePatch(name, module, feature=self.name))

    def apply(self) -> None:
        done: list[Patch] = []
        try:
            for patch in self._patches:
                patch.apply()
                done.append(patch)
        except BaseException as error:
            for patch in reversed(done):
                try:
                    patch.revert()
                except PatchError as revert_error:  # keep the original error; note what stayed applied
                    error.add_note(f"rolling back {patch!r} failed: {revert_error}")
            raise

    def revert(self) -> None:
        for patch in reversed(self._patches):
            if patch.applied:
                patch.revert()

    @property
    def applied(self) -> bool:
        return any(patch.applied for patch in self._patches)

    def targets(self) -> list[str]:
        return [patch.target for patch in self._patches]

    def __iter__(self) -> Iterator[Patch]:
        return iter(self._patches)

    def __len__(self) -> int:
        return len(self._patches)

    def __repr__(self) -> str:
        return f"<PatchSet {self.name}: {len(self)} patches>"
