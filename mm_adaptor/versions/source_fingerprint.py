"""Fingerprints of upstream definitions computed from source text alone (no import).

A dotted target (``megatron.core.tensor_parallel.layers.ColumnParallelLinear.forward``) is found in the
module's source by its bindings: a ``def``/``class``, an assignment, or ``from x import name`` (followed
when it is the only binding), a class attribute falling back to the class's bases. Its fingerprint is a
hash of the definition's syntax tree without positions and docstrings, so reformatting, comments and
docstrings do not count and any change of code does. The same function serves the table made from
Megatron-LM's git tags (scripts/fingerprint_megatron.py) and the live check against the installed files,
so both sides always use one normalisation.
"""

from __future__ import annotations

import ast
import copy
import difflib
import hashlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

# module name -> source text, or None when the module has no source there
SourceReader = Callable[[str], Optional[str]]
ABSENT = None  # a target not defined in a version


@dataclass(frozen=True)
class Definition:
    """Where a target is defined: the module holding the statements and the statements that bind it."""

    module: str
    statements: tuple[ast.stmt, ...]
    source: str

    def text(self) -> str:
        return "\n".join(ast.get_source_segment(self.source, node, padded=True) or "" for node in self.statements)


_DOCUMENTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)


def _without_docstring(body: list) -> list:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
            body[0].value.value, str):
        return body[1:] or [ast.Pass()]
    return body


def canonical(value, *, docstrings: bool = True) -> str:
    """The tree as text, without positions and without empty fields, so that the same code reads the same on every
    Python (3.12 added FunctionDef.type_params, empty for code that has none; ast.dump would print it). Without
    docstrings, each def's, class's and module's leading string is left out (a body of only that reads `Pass()`)."""
    if isinstance(value, ast.AST):
        fields = [(name, getattr(value, name, None)) for name in value._fields]
        if not docstrings and isinstance(value, _DOCUMENTED):
            fields = [(name, _without_docstring(item) if name == "body" else item) for name, item in fields]
        return f"{type(value).__name__}(" + ", ".join(
            f"{name}={canonical(item, docstrings=docstrings)}" for name, item in fields
            if item is not None and item != []) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(canonical(item, docstrings=docstrings) for item in value) + "]"
    return repr(value)


def fingerprint_statements(statements) -> str:
    """16 hex digits for the statements' code: positions, comments, formatting and docstrings do not count."""
    dumped = "\n".join(canonical(node, docstrings=False) for node in statements)
    return hashlib.sha256(dumped.encode()).hexdigest()[:16]


def fingerprint_signature(statements) -> str:
    """16 hex digits for a function's parameters (names, kinds, defaults; annotations aside): the contract of a
    hook that only calls through. A target that is not one function gets its full fingerprint."""
    if len(statements) != 1 or not isinstance(statements[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return fingerprint_statements(statements)
    arguments = copy.deepcopy(statements[0].args)
    for item in ast.walk(arguments):
        if isinstance(item, ast.arg):
            item.annotation = None
    return "sig:" + hashlib.sha256(canonical(arguments).encode()).hexdigest()[:12]


_BLOCKS = (ast.If, ast.Try, ast.With, *((ast.TryStar,) if hasattr(ast, "TryStar") else ()))


def _bound(target: ast.expr) -> set[str]:
    """Names an assignment target binds (`f.warned = False` binds none: it sets an attribute of f)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_bound(item) for item in target.elts))
    if isinstance(target, ast.Starred):
        return _bound(target.value)
    return set()


def _bindings(body: list[ast.stmt], name: str) -> list[ast.stmt]:
    """Statements of one scope (and of its if/try/with blocks, not of nested defs) that bind `name`."""
    found: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if stmt.name == name:
                found.append(stmt)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(name in _bound(t) for t in targets):
                found.append(stmt)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            if any((alias.asname or alias.name.split(".")[0]) == name for alias in stmt.names):
                found.append(stmt)
        if isinstance(stmt, _BLOCKS):
            for block in ("body", "handlers", "orelse", "finalbody"):
                for inner in getattr(stmt, block, None) or []:
                    found.extend(_bindings(inner.body, name) if isinstance(inner, ast.ExceptHandler)
                                 else _bindings([inner], name))
    return found


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    parent = parts if is_package else parts[:-1]
    parent = parent[:len(parent) - (node.level - 1)]
    return ".".join(parent + ([node.module] if node.module else []))


_TREES: dict[str, ast.Module] = {}


class Resolver:
    """Finds targets' definitions through `read` (module name -> source text)."""

    def __init__(self, read: SourceReader):
        self._read = read
        self._parsed: dict[str, tuple[ast.Module, str, bool] | None] = {}

    def module(self, name: str) -> tuple[ast.Module, str, bool] | None:
        if name not in self._parsed:
            self._parsed[name] = None
            text, is_package = self._read(name), False
            if text is None:
                text, is_package = self._read(name + ".__init__"), True
            if text is not None:
                if text not in _TREES:  # one parse per file text for all resolvers (trees are never mutated)
                    _TREES[text] = ast.parse(text)
                self._parsed[name] = (_TREES[text], text, is_package)
        return self._parsed[name]

    def module_of(self, target: str) -> tuple[str, list[str]] | None:
        """(the longest module of the target's path that has source, the attribute chain after it)."""
        parts = target.split(".")
        for index in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:index])
            if self.module(module) is not None:
                return module, parts[index:]
        return None

    def find(self, target: str) -> Definition | None:
        found = self.module_of(target)
        return None if found is None else self._lookup(*found, depth=0)

    def _lookup(self, module: str, chain: list[str], depth: int) -> Definition | None:
        if depth > 20:
            return None
        tree, text, is_package = self.module(module)
        statements = _bindings(tree.body, chain[0])
        if not statements:
            return None
        if len(statements) == 1 and isinstance(statements[0], ast.ImportFrom):
            alias = next(a for a in statements[0].names if (a.asname or a.name) == chain[0])
            source = _absolute(module, statements[0], is_package)
            if self.module(source) is not None:
                found = self._lookup(source, [alias.name, *chain[1:]], depth + 1)
                if found is not None:
                    return found
            if self.module(f"{source}.{alias.name}") is not None and len(chain) > 1:
                return self._lookup(f"{source}.{alias.name}", chain[1:], depth + 1)
            return None if len(chain) > 1 else Definition(module, tuple(statements), text)
        if len(chain) == 1:
            return Definition(module, tuple(statements), text)
        last = statements[-1]
        if not isinstance(last, ast.ClassDef):
            return None
        return self._in_class(module, last, chain[1:], depth)

    def _in_class(self, module: str, klass: ast.ClassDef, chain: list[str], depth: int) -> Definition | None:
        own = _bindings(klass.body, chain[0])
        if own:
            if len(chain) == 1:
                return Definition(module, tuple(own), self.module(module)[1])
            if isinstance(own[-1], ast.ClassDef):
                return self._in_class(module, own[-1], chain[1:], depth)
            return None
        for base in klass.bases:  # inherited: the first base (in order) defining it, as the MRO mostly does
            dotted = ast.unparse(base)
            found = self._lookup(module, [*dotted.split("."), *chain], depth + 1)
            if found is not None:
                return found
        return None


def fingerprint_target(target: str, read: SourceReader, resolver: Resolver | None = None, *,
                       signature_only: bool = False) -> str | None:
    """The target's fingerprint in the sources `read` gives, or None when it is not defined there."""
    found = (resolver or Resolver(read)).find(target)
    if found is None:
        return None
    return (fingerprint_signature if signature_only else fingerprint_statements)(found.statements)


def changed_lines(old: Definition | None, new: Definition | None) -> int:
    """Lines added plus lines removed between two definitions' source text (all of one when the other is absent)."""
    before = old.text().splitlines() if old else []
    after = new.text().splitlines() if new else []
    diff = difflib.unified_diff(before, after, lineterm="", n=0)
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))


def installed_source(module: str) -> str | None:
    """The source text of `module` as installed, read from its file without importing it (an already imported
    module's own file; otherwise found along its top-level package's search path)."""
    name, init = (module[:-len(".__init__")], True) if module.endswith(".__init__") else (module, False)
    loaded = sys.modules.get(name)
    path = getattr(loaded, "__file__", None)
    if path and (os.path.basename(path) == "__init__.py") == init:
        return _read_file(path)
    top = name.split(".")[0]
    try:
        spec = sys.modules[top].__spec__ if top in sys.modules else importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    relative = name.split(".")[1:]
    tail = os.path.join(*relative, "__init__.py") if init else (os.path.join(*relative) + ".py" if relative else None)
    if tail is None:
        return _read_file(spec.origin) if spec.origin and init else None
    for location in spec.submodule_search_locations or ():
        text = _read_file(os.path.join(location, tail))
        if text is not None:
            return text
    return None


def _read_file(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


def installed_module(target: str) -> str | None:
    """The installed module holding the target's path (None: none of it is installed, e.g. Megatron-LM's
    megatron.training beside a megatron-core wheel that lacks it)."""
    found = Resolver(installed_source).module_of(target)
    return found[0] if found else None


def installed_fingerprint(target: str, *, signature_only: bool = False) -> str | None:
    return fingerprint_target(target, installed_source, signature_only=signature_only)
