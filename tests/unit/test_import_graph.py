"""The package's shape: no import circle between its modules, imports only in the allowed directions between its
parts, no source file over the size limit.

The import graph is read from the source (ast), not from sys.modules, so imports inside functions count
too: a circle hidden in a function still ties two modules together, it only fails later.
"""
from __future__ import annotations

import ast
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
# Where each installed package's sources sit (pyproject's package-dir mapping).
PACKAGES = {
    "mm_adaptor": REPO / "mm_adaptor",
    "mm_adaptor.patches": REPO / "patches",
    "mm_adaptor.feature_flags": REPO / "feature_flags",
    "mm_adaptor.ops": REPO / "ops",
}
MAX_LINES = 400


def module_files(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py under the package roots."""
    files: dict[str, Path] = {}
    for package, root in packages.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            # a nested package-dir entry (mm_adaptor.patches) owns its own tree; a stray copy does not override it
            files.setdefault(name, path)
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """Every import statement that can run: at module level, in functions and classes, not under TYPE_CHECKING."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def import_graph(packages: dict[str, Path] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the package's own modules it imports (anywhere in its body).

    `from a.b import c` is an edge to a.b.c when that is a module, else to a.b; the parent packages
    Python also runs on the way are not edges (every submodule would otherwise sit in a circle
    with the __init__ that re-exports it).
    """
    files = module_files(packages)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = here[: len(here) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            for target in targets:
                # `import a.b.c` names a.b.c; keep the longest prefix that is one of ours
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component with more than one module (Tarjan), as a path a -> ... -> a."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(root: str) -> None:
        # iterative, so a deep chain of imports cannot hit the recursion limit
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle_through(graph, sorted(component)) for component in sorted(components)]


def _circle_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """The shortest circle from the component's first module back to itself (breadth-first inside it)."""
    members = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def oversized_files(roots=None, limit: int = MAX_LINES, base: Path = REPO) -> list[str]:
    """Only the files over the limit, each with its length, so the failure is the to-do list."""
    roots = PACKAGES.values() if roots is None else roots
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > limit:
                found.append(f"{path.relative_to(base)}: {lines} lines")
    return found


# The machinery every part builds on imports none of the parts: the core package and the contract modules of the
# versions package (what a patch checks before it applies). Folder-level rules say the same for the parts.
CORE = ("mm_adaptor.core", "mm_adaptor.versions.contracts", "mm_adaptor.versions.source_fingerprint",
        "mm_adaptor.versions.fingerprint_cache", "mm_adaptor.versions.fingerprint_table")
PARTS = ("mm_adaptor.feature_flags", "mm_adaptor.patches", "mm_adaptor.devices", "mm_adaptor.ops",
         "mm_adaptor.train", "mm_adaptor.harness", "mm_adaptor.models", "mm_adaptor.data", "mm_adaptor.convert",
         "mm_adaptor.ranks", "mm_adaptor.versions", "mm_adaptor.cli", "mm_adaptor.mindspeed_mm")
COMMANDS = ("mm_adaptor.cli",)
# part -> the parts it must never import (it may import the core, and what is not listed)
NEVER = {
    "mm_adaptor.patches": ("mm_adaptor.feature_flags", "mm_adaptor.train", "mm_adaptor.harness",
                           "mm_adaptor.convert", "mm_adaptor.data", "mm_adaptor.models", "mm_adaptor.ranks",
                           *COMMANDS),
    "mm_adaptor.devices": ("mm_adaptor.feature_flags", "mm_adaptor.patches", "mm_adaptor.train",
                           "mm_adaptor.harness", "mm_adaptor.convert", "mm_adaptor.ranks", *COMMANDS),
    "mm_adaptor.ops": ("mm_adaptor.feature_flags", "mm_adaptor.patches", "mm_adaptor.train", "mm_adaptor.harness",
                       *COMMANDS),
    "mm_adaptor.feature_flags": ("mm_adaptor.train", "mm_adaptor.harness", "mm_adaptor.ranks", *COMMANDS),
    "mm_adaptor.convert": ("mm_adaptor.train", "mm_adaptor.harness", *COMMANDS),
    "mm_adaptor.data": ("mm_adaptor.train", "mm_adaptor.harness", *COMMANDS),
    "mm_adaptor.mindspeed_mm": ("mm_adaptor.train", "mm_adaptor.harness", *COMMANDS),
    "mm_adaptor.train": ("mm_adaptor.harness",),
    # local ranks know nothing of what runs in them
    "mm_adaptor.ranks": tuple(part for part in PARTS if part != "mm_adaptor.ranks"),
}


def _in(module: str, area: str) -> bool:
    return module == area or module.startswith(area + ".")


def wrong_directions(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if any(_in(module, c) for c in CORE) and not any(_in(target, c) for c in CORE):
                found.append(f"{module} -> {target} (the core imports only the core)")
            for part, never in NEVER.items():
                if _in(module, part) and any(_in(target, other) for other in never):
                    found.append(f"{module} -> {target} ({part} never imports {', '.join(never)})")
    return found


# ---------------------------------------------------------------------------------------------------------------

def test_imports_go_one_way_between_the_parts():
    graph = import_graph()
    assert all(any(_in(m, part) for m in graph) for part in PARTS + CORE)
    found = wrong_directions(graph)
    assert not found, "imports against the direction (imports inside functions count):\n" + "\n".join(found)


def test_an_upward_import_inside_a_function_is_named(tmp_path):
    graph = {"mm_adaptor.core.features": {"mm_adaptor.feature_flags.coc"},
             "mm_adaptor.devices.base": {"mm_adaptor.patches.x", "mm_adaptor.core.errors"},
             "mm_adaptor.train.loop": {"mm_adaptor.devices.base"}}
    assert wrong_directions(graph) == [
        "mm_adaptor.core.features -> mm_adaptor.feature_flags.coc (the core imports only the core)",
        "mm_adaptor.devices.base -> mm_adaptor.patches.x (mm_adaptor.devices never imports "
        + ", ".join(NEVER["mm_adaptor.devices"]) + ")"]



def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 100 and "mm_adaptor.patches.tensor_parallel.cross_entropy" in graph  # all four trees read
    assert "mm_adaptor.data" in graph["mm_adaptor.train.vlm_data"]  # an import inside a method is an edge
    found = cycles(graph)
    assert not found, "import circles (imports inside functions count; one circle per knot of modules):\n" + \
        "\n".join(" -> ".join(circle) for circle in found)


def test_no_source_file_over_the_line_limit():
    found = oversized_files()
    assert not found, f"files over {MAX_LINES} lines (split them along their seams):\n" + "\n".join(found)


def _write(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_circle_hidden_in_a_function_is_found_and_named(tmp_path):
    _write(tmp_path / "pkg", {
        "__init__.py": "from pkg.a import run\n",
        "a.py": "from pkg import b\n\ndef run():\n    return b.helper()\n",
        "b.py": "def helper():\n    from pkg.sub.c import VALUE\n    return VALUE\n",
        "sub/__init__.py": "",
        "sub/c.py": "from ..a import run\nVALUE = 1\n",  # relative import back to a: a -> b -> c -> a
        "d.py": "from pkg.sub import c\n",  # imports into the circle, not part of it
    })
    graph = import_graph({"pkg": tmp_path / "pkg"})
    assert graph["pkg.sub.c"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.sub.c"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_a_mapped_subpackage_and_type_checking_imports(tmp_path):
    # pkg.extra lives outside pkg/ (like patches/ -> mm_adaptor.patches); imports only a type checker runs are no edge
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/core.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.extra.x import X\n"
                       "else:\n    import json\n",
        "extra/__init__.py": "",
        "extra/x.py": "import pkg.core\nclass X: ...\n",
    })
    graph = import_graph({"pkg": tmp_path / "pkg", "pkg.extra": tmp_path / "extra"})
    assert graph["pkg.extra.x"] == {"pkg.core"} and graph["pkg.core"] == set()
    assert cycles(graph) == []
    (tmp_path / "pkg/core.py").write_text("def late():\n    from pkg.extra import x\n")
    assert cycles(import_graph({"pkg": tmp_path / "pkg", "pkg.extra": tmp_path / "extra"})) == [
        ["pkg.core", "pkg.extra.x", "pkg.core"]]


def test_the_size_limit_names_the_long_file(tmp_path):
    _write(tmp_path, {"short.py": "x = 1\n" * 400, "deep/long.py": "x = 1\n" * 401})
    assert oversized_files([tmp_path], base=tmp_path) == ["deep/long.py: 401 lines"]
