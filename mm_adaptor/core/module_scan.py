"""Which imported modules hold an object: where `from x import f` left by-value copies that a patch rebinds."""

from __future__ import annotations

import sys
from typing import Any

_module_replacements = 0  # modules replaced under their names in sys.modules (module patches, applied or reverted)


def note_module_replaced() -> None:
    global _module_replacements
    _module_replacements += 1


def holders(prefixes: tuple[str, ...], objects: list) -> dict[int, list[tuple[str, Any, str]]]:
    """id(obj) -> (module name, module, attribute) for every module under `prefixes` holding obj: one pass over
    sys.modules for any number of objects (it holds thousands of modules)."""
    found: dict[int, list[tuple[str, Any, str]]] = {id(obj): [] for obj in objects}
    if not found or not prefixes:
        return found  # (a set of module patches, or none: its scan looks for nothing)
    for mod_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) if module is not None and mod_name.startswith(prefixes) else None
        if not isinstance(namespace, dict) or found.keys().isdisjoint(map(id, list(namespace.values()))):
            continue  # most modules: the test above is one pass in C
        for attr, value in list(namespace.items()):
            entries = found.get(id(value))
            if entries is not None:
                entries.append((mod_name, module, attr))
    return found


class Scan:
    """One pass over sys.modules for the originals of many patches (a set's, or several sets'), before any is
    applied: a pass per patch cost ~1 s per rank start. Equal to passes per patch: a holder is used only while it
    still holds the original (the patch checks) and while no module under the prefixes was imported or replaced."""

    def __init__(self, originals: list, prefixes: tuple[str, ...]):
        found = holders(prefixes, originals)
        self._found = {id(obj): (obj, found[id(obj)]) for obj in originals}
        self._prefixes = prefixes
        self._module_names, self._replacements = set(sys.modules), _module_replacements

    def holders_of(self, original, prefixes: tuple[str, ...]) -> list[tuple[Any, str]] | None:
        """(module, attribute) pairs under `prefixes` holding `original` when scanned; None: scan again."""
        if self._replacements != _module_replacements or any(
                name.startswith(self._prefixes) for name in sys.modules.keys() - self._module_names):
            return None
        entry = self._found.get(id(original))
        if entry is None or entry[0] is not original or not set(prefixes) <= set(self._prefixes):
            return None
        return [(module, attr) for name, module, attr in entry[1] if name.startswith(prefixes)]

    def note_installed(self, installed, holders: list[tuple[Any, str]]) -> None:
        """A patch set `installed` at `holders` (its target and the copies it rebound): a later patch whose original
        it is (a second target of the same replacement, a wrap over it) finds its holders here instead of in another
        pass. Holders it had before count only if this scan looked for it (a replacement's object)."""
        before = self._found.get(id(installed))
        known = before[1] if before is not None and before[0] is installed else []
        added = [(getattr(module, "__name__", ""), module, attr) for module, attr in holders]
        self._found[id(installed)] = (installed, known + [entry for entry in added if entry not in known])
