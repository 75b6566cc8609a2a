"""Versioned, reversible patches of dotted targets.

A Patch says explicitly whether it replaces or wraps its target, carries a Contract (mm_adaptor.versions.contracts:
the original's fingerprint per megatron-core version and the versions its feature was verified on), rebinds
by-value copies of the original in other imported modules, and reverts all of it exactly, including copies of
the patched object that modules imported while the patch was active made.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Iterable, Iterator

import wrapt

from mm_adaptor.core import module_scan
from mm_adaptor.versions.contracts import (  # noqa: F401  (the contract API is used through this module)
    ALLOW_MISMATCH_ENV,
    SUPPORTED_MEGATRON_CORE,
    Contract,
    PatchContractError,
    PatchContractWarning,
    PatchError,
    fingerprint,
)

MODES = ("replace", "wrap")
_MISSING = object()


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


def _installed_holders(patches: list) -> dict["Patch", list[tuple[Any, str]]] | None:
    """For each patch, the modules holding its installed object, from one scan; None when two patches share a
    target (reverting one changes what the other must find: each scans for itself then)."""
    following = [p for p in patches if isinstance(p, Patch) and p._follows_installed_copies()]
    if len({p.target for p in following}) != len(following):
        return None
    prefixes = tuple({prefix for p in following for prefix in p._prefixes(p._owner)})
    found = module_scan.holders(prefixes, [p._installed for p in following]) if following else {}
    return {p: [(module, attr) for name, module, attr in found[id(p._installed)]
                if module is not p._owner and name.startswith(p._prefixes(p._owner))] for p in following}


def bound_arguments(names, args: tuple, kwargs: dict, *, named_only: bool = False) -> dict:
    """A call's arguments by parameter name, for the wrappers that read a few arguments of the call they wrap: the
    positional ones named in order, then the keywords (with named_only, only those in `names`)."""
    bound = dict(zip(names, args))
    bound.update((key, value) for key, value in kwargs.items() if not named_only or key in names)
    return bound


class Patch:
    """Replace or wrap one dotted target. `new` is the replacement, or a wrapt
    wrapper(wrapped, instance, args, kwargs)."""

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
        self.calls = 0  # calls of the installed wrapper since apply (None for a replacement: not counted)

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

    def _counted(self, wrapped, instance, args, kwargs):
        self.calls += 1
        return self.new(wrapped, instance, args, kwargs)

    def _build(self, original):
        """The installed object: a wrapper counts its calls; a replacement is installed as it is (code may test
        its identity), uncounted."""
        if self.mode == "replace":
            self.calls = None
            return self.new
        if isinstance(original, (staticmethod, classmethod)):
            return type(original)(wrapt.FunctionWrapper(original.__func__, self._counted))
        if not callable(original):
            raise PatchError(
                f"cannot wrap {self.target}: {type(original).__name__} is not callable; use mode='replace'"
            )
        return wrapt.FunctionWrapper(original, self._counted)

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

    def apply(self, *, scanned: "module_scan.Scan | None" = None) -> None:
        """`scanned`: where the original is held, when the caller scanned for it (PatchSet scans for all at once)."""
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
        self.calls = 0
        installed = self._build(original)
        setattr(owner, name, installed)
        self._owner, self._name, self._was_own = owner, name, own
        self._original, self._installed = original, installed
        self._copies = []
        if original is not _MISSING and not isinstance(owner, type) and _has_identity(original):
            self._rebind_copies(owner, original, installed, scanned)
        if scanned is not None and not isinstance(owner, type) and _has_identity(installed):
            scanned.note_installed(installed, [(owner, name), *self._copies])
        self._applied = True
        _ACTIVE.append(self)

    def _prefixes(self, owner) -> tuple[str, ...]:
        root = getattr(owner, "__name__", "").split(".")[0]
        return tuple({*self.rebind_prefixes, root} - {""})

    def _holders_of(self, owner, obj) -> list[tuple[Any, str]]:
        """(module, attribute) for every module under the rebind prefixes (owner excluded) holding obj."""
        return [(module, attr) for name, module, attr in module_scan.holders(self._prefixes(owner), [obj])[id(obj)]
                if module is not owner]

    def _rebind_copies(self, owner, original, installed, scanned: "module_scan.Scan | None" = None) -> None:
        known = scanned and scanned.holders_of(original, self._prefixes(owner))  # None: scan here
        holders = self._holders_of(owner, original) if known is None else [
            (module, attr) for module, attr in known if module is not owner and module.__dict__.get(attr) is original]
        for module, attr in holders:
            setattr(module, attr, installed)
            self._copies.append((module, attr))

    def _follows_installed_copies(self) -> bool:
        return self.applied and not isinstance(self._owner, type) and _has_identity(self._installed)

    def _restore_copies(self, installed_holders: list[tuple[Any, str]] | None) -> None:
        """Copies rebound at apply time, and copies of the installed object that modules imported since
        made (`from x import f` while the patch was active), go back to the original (or away, if the
        patch created the target)."""
        copies = list(self._copies)
        if self._follows_installed_copies():
            if installed_holders is None:
                installed_holders = self._holders_of(self._owner, self._installed)
            # An object installed on several targets (one class for two names): only same-named copies are ours.
            shared = any(p is not self and getattr(p, "_installed", None) is self._installed for p in _ACTIVE)
            copies += [c for c in installed_holders if c not in copies and (not shared or c[1] == self._name)]
        for module, attr in copies:
            if module.__dict__.get(attr) is not self._installed:
                continue  # rebound by someone else since: theirs now
            if self._original is _MISSING:
                delattr(module, attr)
            else:
                setattr(module, attr, self._original)

    def revert(self, *, installed_holders: list[tuple[Any, str]] | None = None) -> None:
        """`installed_holders`: the modules holding the installed object, when the caller scanned for them
        already (PatchSet scans once for all its patches)."""
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
        self._restore_copies(installed_holders)
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
        module_scan.note_module_replaced()
        self.applied = True
        _ACTIVE.append(self)

    def revert(self) -> None:
        if not self.applied:
            raise PatchError(f"{self.target} is not applied")
        if self._previous is _MISSING:
            sys.modules.pop(self.name, None)
        else:
            sys.modules[self.name] = self._previous
        module_scan.note_module_replaced()
        self.applied = False
        _ACTIVE.remove(self)


def _scan_before_applying(patches: list) -> "module_scan.Scan | None":
    """One scan for all originals of `patches` before any is applied; None (each patch scans for itself) with module
    patches or repeated targets. Originals a patch installs are left to their patch."""
    if any(not isinstance(p, Patch) for p in patches) or len({p.target for p in patches}) != len(patches):
        return None
    originals, prefixes, installing = {}, set(), {id(p.new) for p in patches}
    # where a replacement's object already is: once installed it may be another patch's original (note_installed)
    replacements = [p.new for p in patches if p.mode == "replace" and _has_identity(p.new)]
    for patch in patches:
        try:
            owner, name = resolve(patch.target)
        except PatchError:
            continue  # its own apply raises
        original, _ = Patch._raw_attribute(owner, name)
        if (original is not _MISSING and not isinstance(owner, type) and _has_identity(original)
                and id(original) not in installing):
            originals[id(original)] = original
            prefixes.update(patch._prefixes(owner))
    scanned = {**originals, **{id(new): new for new in replacements}}
    return module_scan.Scan(list(scanned.values()), tuple(sorted(prefixes)))


class PatchSet:
    """Ordered patches applied all-or-nothing and reverted in reverse order.

    A compatibility set (no feature flag) also says what it changes, what unpatched megatron does
    without it, where it is needed, and, when it has nothing to patch here, why (`mm-adaptor report`)."""

    def __init__(self, name: str, patches: Iterable[Patch] = (), *, changes: str = "", unpatched: str = "",
                 needed_on: str = "", not_needed: str = ""):
        self.name = name
        self._patches: list[Patch] = list(patches)
        self.changes, self.unpatched, self.needed_on, self.not_needed = changes, unpatched, needed_on, not_needed

    def add(self, patch: "Patch | ModulePatch") -> "Patch | ModulePatch":
        self._patches.append(patch)
        return patch

    def replace(self, target: str, new, contract: Contract | None = None, *, create: bool = False) -> Patch:
        return self.add(Patch(target, new, mode="replace", contract=contract, feature=self.name, create=create))

    def wrap(self, target: str, wrapper: Callable, contract: Contract | None = None) -> Patch:
        return self.add(Patch(target, wrapper, mode="wrap", contract=contract, feature=self.name))

    def provide_module(self, name: str, module) -> ModulePatch:
        return self.add(ModulePatch(name, module, feature=self.name))

    def apply(self, *, scanned: "module_scan.Scan | None" = None) -> None:
        """`scanned`: apply_all's one scan for several sets."""
        done: list[Patch] = []
        try:
            scanned = scanned or _scan_before_applying(self._patches)
            for patch in self._patches:
                patch.apply(scanned=scanned) if isinstance(patch, Patch) else patch.apply()
                done.append(patch)
        except BaseException as error:
            for patch in reversed(done):
                try:
                    patch.revert()
                except PatchError as revert_error:  # keep the original error; note what stayed applied
                    error.add_note(f"rolling back {patch!r} failed: {revert_error}")
            raise

    def revert(self) -> None:
        holders = _installed_holders(self._patches) or {}
        for patch in reversed(self._patches):
            if patch.applied:
                if patch in holders:
                    patch.revert(installed_holders=holders[patch])
                else:
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


def apply_all(patch_sets: list[PatchSet]) -> None:
    """Each set applied in order, all or none, with one scan of sys.modules for all their originals."""
    scanned = _scan_before_applying([patch for patch_set in patch_sets for patch in patch_set
                                     if isinstance(patch, Patch)])
    applied: list[PatchSet] = []
    try:
        for patch_set in patch_sets:
            patch_set.apply(scanned=scanned)
            applied.append(patch_set)
    except BaseException:
        for patch_set in reversed(applied):
            patch_set.revert()
        raise
