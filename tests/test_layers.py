"""The layers of ``docs/architecture.md`` hold in the code, and the doc lists every module.

Every ``import`` of every module under ``lowprec/`` is parsed (AST: at module level, inside
functions and classes, ``import x``, ``from x import y``, relative imports) and

* points downward: a module imports only its own package (a *unit*: ``core/``, ``amp/``,
  ..., or a top-level module such as ``_faults.py``) and the units on lines *before* its
  own in the layers block of ``docs/architecture.md`` (the fenced block under "## Layers",
  bottom first; units on one line are siblings and do not import each other). The order
  is read from the doc, so doc and test cannot drift;
* closes no cycle among lowprec modules, lazy imports counted (imports under
  ``if TYPE_CHECKING:`` never run and count only for the layers);
* uses no other unit's private names (``from lowprec.x.y import _name``, a private module
  ``lowprec.x._y``, or ``module._name`` on a module of another unit).

And ``docs/architecture.md`` lists every module file of ``lowprec/``; test modules import
no other test module (``test_*.py``) nor a ``conftest.py`` (shared helpers are plain
functions in ``_``-prefixed modules: ``tests/_helpers.py``, ``tests/_bits.py``, a folder's
own ``_*.py``; ``conftest.py`` holds fixtures and hooks); and ``tests/core`` imports
nothing of lowprec above the core.

Known violations are allow-listed below, each with its reason; each entry is to be
removed when its code is fixed (a stale entry fails, so that the lists only shrink).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "lowprec"
TESTS = ROOT / "tests"
DOC = ROOT / "docs" / "architecture.md"

# ---------------------------------------------------------------------------------------
# Allow-lists of known violations: each entry is to be removed (fix the code, then delete
# the entry; a stale entry fails test_allow_lists_are_not_stale).
# ---------------------------------------------------------------------------------------

# (importer, imported) module pairs that point upward or sideways against the layers.
# Cycles through these edges are part of the same violation and are not reported again.
UPWARD_ALLOWED: dict[tuple[str, str], str] = {}

# (importer, imported) edges inside one package that close an import cycle (a lazy import).
CYCLE_ALLOWED: dict[tuple[str, str], str] = {}

# (importer, "module.name") uses of another unit's private names.
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {}

# ---------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_of(path: Path, name: str) -> str:
    """The package a relative import of ``path`` (module ``name``) starts from."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # the module imported (or the module a name is imported from)
    names: tuple[str, ...]  # names imported from target (empty for ``import x``)
    line: int
    lazy: bool  # inside a function
    type_only: bool  # under ``if TYPE_CHECKING:``

    def where(self) -> str:
        return f"{self.importer}:{self.line}"


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(
    node: ast.AST, lazy: bool = False, type_only: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, lazy, type_only
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, True, type_only)
        elif isinstance(child, ast.If) and _type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), lazy, True)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), lazy, type_only)
        else:
            yield from _walk(child, lazy, type_only)


def imports_of(path: Path, name: str) -> list[Import]:
    """Every import statement of the file ``path`` (module ``name``), resolved to absolute
    module names (``from pkg import sub`` of a submodule: the submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out = []
    for node, lazy, type_only in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(name, alias.name, (), node.lineno, lazy, type_only))
            continue
        base = node.module or ""
        if node.level:
            pkg = package_of(path, name).split(".")
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join([*pkg, base] if base else pkg)
        for alias in node.names:
            out.append(Import(name, base, (alias.name,), node.lineno, lazy, type_only))
    return out


def lowprec_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


MODULES = lowprec_modules()


def resolve(target: str, names: tuple[str, ...], modules: dict[str, Path]) -> list[str]:
    """The lowprec modules an import reaches: ``from a import b`` reaches the module
    ``a.b`` if there is one, else ``a``; the nearest existing module otherwise."""
    if names and f"{target}.{names[0]}" in modules:
        return [f"{target}.{names[0]}"]
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return [target] if target else []


def edges(modules: dict[str, Path] = MODULES) -> list[tuple[Import, str]]:
    """``(import, module reached)`` for every import of a lowprec module by a lowprec
    module (one per imported name)."""
    out = []
    for name, path in modules.items():
        for imp in imports_of(path, name):
            if imp.target != "lowprec" and not imp.target.startswith("lowprec."):
                continue
            for t in resolve(imp.target, imp.names, modules):
                if t != name:
                    out.append((imp, t))
    return out


def unit(module: str) -> str:
    """The unit of the layers a lowprec module belongs to: ``core/`` for
    ``lowprec.core.x``, ``_faults.py`` for ``lowprec._faults``, ``__init__.py`` for the
    facade ``lowprec``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    if (PKG / parts[1]).is_dir():
        return parts[1] + "/"
    return parts[1] + ".py"


# ---------------------------------------------------------------------------------------
# The doc
# ---------------------------------------------------------------------------------------


def doc_layers(text: str | None = None) -> list[list[str]]:
    """The units of each line of the fenced block under "## Layers" of the architecture
    doc, bottom first: the names ending in ``/`` or ``.py`` at the start of each line
    after ``lowprec/``."""
    text = DOC.read_text(encoding="utf-8") if text is None else text
    section = text.split("\n## Layers", 1)[1]
    block = re.search(r"```[^\n]*\n(.*?)```", section, re.S)
    assert block, "docs/architecture.md: no fenced block under '## Layers'"
    lines = block.group(1).splitlines()
    assert lines and lines[0].split()[0] == "lowprec/", "the layers block starts at lowprec/"
    layers = []
    for line in lines[1:]:
        units = []
        for token in line.split():
            if not (token.endswith("/") or token.endswith(".py")):
                break
            units.append(token)
        if units:
            layers.append(units)
    return layers


def layer_index() -> dict[str, int]:
    index: dict[str, int] = {}
    for i, units in enumerate(doc_layers()):
        for u in units:
            assert u not in index, f"docs/architecture.md: {u} is on two lines of the layers"
            index[u] = i
    return index


# ---------------------------------------------------------------------------------------
# Layers and cycles
# ---------------------------------------------------------------------------------------


def test_the_layers_block_names_every_unit() -> None:
    index = layer_index()
    units = {unit(m) for m in MODULES}
    missing = sorted(units - set(index))
    stale = sorted(set(index) - units)
    assert not missing, f"docs/architecture.md's layers block lacks {missing}"
    assert not stale, f"docs/architecture.md's layers block names {stale}, not in lowprec/"


def upward_imports() -> list[str]:
    index = layer_index()
    bad = []
    for imp, target in edges():
        a, b = unit(imp.importer), unit(target)
        if a == b or (imp.importer, target) in UPWARD_ALLOWED:
            continue
        if index[b] >= index[a]:
            how = "a sibling" if index[b] == index[a] else "a layer above"
            bad.append(f"{imp.where()} imports {target} ({b}: {how} {a})")
    return bad


def test_imports_point_downward() -> None:
    bad = upward_imports()
    assert not bad, "imports against the layers of docs/architecture.md:\n" + "\n".join(bad)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                sccs.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in sccs:  # a shortest cycle through the component's first module (BFS)
        start = min(comp)
        prev: dict[str, str] = {}
        queue = [start]
        while queue:
            v = queue.pop(0)
            for w in sorted(graph.get(v, ())):
                if w == start:  # back at the start: the path there, read backwards
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    cycles.append([*reversed(path), start])
                    queue = []
                    break
                if w in comp and w not in prev and w != start:
                    prev[w] = v
                    queue.append(w)
    return cycles


def import_graph(with_allowed: bool = False) -> dict[str, set[str]]:
    """lowprec modules and the modules each imports at run time (``with_allowed=False``:
    less the allow-listed edges)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp, target in edges():
        allowed = not with_allowed and (imp.importer, target) in UPWARD_ALLOWED | CYCLE_ALLOWED
        if not imp.type_only and not allowed:
            graph[imp.importer].add(target)
    return graph


def reaches(graph: dict[str, set[str]], src: str, dst: str) -> bool:
    seen, todo = {src}, [src]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w == dst:
                return True
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return False


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    text = "\n".join(" -> ".join(c) for c in cycles)
    assert not cycles, f"import cycles among lowprec modules (lazy imports counted):\n{text}"


def test_find_cycles_prints_the_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["e", "e"]]


def test_the_core_has_no_lazy_imports_of_itself() -> None:
    """Issue 29: the core's modules were split so that none needs an import inside a
    function to dodge a cycle."""
    lazy = [
        f"{imp.where()} imports {t}"
        for imp, t in edges()
        if imp.lazy and unit(imp.importer) == "core/" and unit(t) == "core/"
    ]
    assert not lazy, "\n".join(lazy)


def test_imports_of_reads_every_kind(tmp_path: Path) -> None:
    f = tmp_path / "lowprec" / "a" / "m.py"
    f.parent.mkdir(parents=True)
    f.write_text(
        "import lowprec.b\nfrom . import n\nfrom ..c import x\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lowprec.d import y\n"
        "class K:\n    def g(self):\n        from lowprec.e import z\n"
    )
    got = [(i.target, i.names, i.lazy, i.type_only) for i in imports_of(f, "lowprec.a.m")]
    assert got == [
        ("lowprec.b", (), False, False),
        ("lowprec.a", ("n",), False, False),
        ("lowprec.c", ("x",), False, False),
        ("typing", ("TYPE_CHECKING",), False, False),
        ("lowprec.d", ("y",), False, True),
        ("lowprec.e", ("z",), True, False),
    ]


def test_doc_layers_parse() -> None:
    text = "x\n## Layers\n\n```\nlowprec/\n  a/  b.py   words a/ here\n\n  c/ more\n```\n"
    assert doc_layers(text) == [["a/", "b.py"], ["c/"]]


# ---------------------------------------------------------------------------------------
# Private names
# ---------------------------------------------------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.expr) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_uses() -> list[tuple[str, str, int]]:
    """``(importer, "module.name", line)`` for each use of a private name (or module) of
    another unit."""
    out = []
    for name, path in MODULES.items():
        me = unit(name)
        bound: dict[str, str] = {}  # local name -> lowprec module
        for imp in imports_of(path, name):
            if imp.target != "lowprec" and not imp.target.startswith("lowprec."):
                continue
            tparts = imp.target.split(".")
            for i, part in enumerate(tparts[2:], start=2):  # a private module below a unit
                if _private(part) and unit(imp.target) != me:
                    out.append((name, ".".join(tparts[: i + 1]), imp.line))
                    break
            if not imp.names:  # import lowprec.x.y: binds lowprec
                bound[tparts[0]] = tparts[0]
                continue
            for n in imp.names:
                full = f"{imp.target}.{n}"
                if full in MODULES:
                    bound[n] = full
                    if unit(full) == f"{n}.py":  # a top-level module is a unit of its own
                        continue
                if _private(n) and unit(imp.target) != me:
                    out.append((name, full, imp.line))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            chain = _dotted(node.value)
            if chain is None or chain[0] not in bound:
                continue
            mod = bound[chain[0]]
            for part in chain[1:]:
                if f"{mod}.{part}" not in MODULES:
                    mod = ""
                    break
                mod = f"{mod}.{part}"
            if mod and unit(mod) != me:
                out.append((name, f"{mod}.{node.attr}", node.lineno))
    return out


def test_no_unit_uses_another_units_private_names() -> None:
    bad = sorted(
        f"{imp}:{line} uses {what}"
        for imp, what, line in private_uses()
        if (imp, what) not in PRIVATE_ALLOWED
    )
    assert not bad, "private names used across lowprec's packages:\n" + "\n".join(bad)


def test_allow_lists_are_not_stale() -> None:
    upward = {(imp.importer, t) for imp, t in edges()}
    private = {(imp, what) for imp, what, _ in private_uses()}
    stale = [f"UPWARD_ALLOWED {k}" for k in UPWARD_ALLOWED if k not in upward]
    graph = import_graph(with_allowed=True)
    stale += [
        f"CYCLE_ALLOWED {(a, b)}"
        for a, b in CYCLE_ALLOWED
        if b not in graph[a] or not reaches(graph, b, a)
    ]
    stale += [f"PRIVATE_ALLOWED {k}" for k in PRIVATE_ALLOWED if k not in private]
    assert not stale, "fixed: remove from tests/test_layers.py's allow-lists:\n" + "\n".join(stale)


# ---------------------------------------------------------------------------------------
# The doc lists every module
# ---------------------------------------------------------------------------------------


def doc_listed(text: str) -> set[str]:
    """Module paths (relative to ``lowprec/``) that the doc lists: ```pkg/name.py``` or
    ```name.py``` anywhere, and ```name.py``` in a package's section (a heading or a
    bullet that starts with ```pkg/```, up to the next heading naming another)."""
    listed = set(re.findall(r"`([\w/]+\.py)`", text))
    context: str | None = None
    for line in text.splitlines():
        heading = line.startswith("#")
        pkgs = re.findall(r"`(\w+)/`", line)
        if heading:
            context = pkgs[0] if len(pkgs) == 1 else None
        elif re.match(r"\s*[-*] `(\w+)/`", line):
            context = pkgs[0]
        if context:
            for f in re.findall(r"`(\w+\.py)`", line):
                listed.add(f"{context}/{f}")
    return listed


def test_the_doc_lists_every_module() -> None:
    listed = doc_listed(DOC.read_text(encoding="utf-8"))
    files = [p.relative_to(PKG).as_posix() for p in MODULES.values()]
    missing = sorted(f for f in files if not f.endswith("__init__.py") and f not in listed)
    assert not missing, "docs/architecture.md does not list " + ", ".join(missing)


# ---------------------------------------------------------------------------------------
# Tests import no test modules; the core's tests import only the core
# ---------------------------------------------------------------------------------------


def all_test_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(TESTS.rglob("*.py"))}


def test_no_test_module_imports_a_test_module_or_a_conftest() -> None:
    mods = all_test_modules()
    bad = []
    for name, path in mods.items():
        for imp in imports_of(path, name):
            if imp.target != "tests" and not imp.target.startswith("tests."):
                continue
            for t in resolve(imp.target, imp.names, mods):
                last = t.rpartition(".")[2]
                if last.startswith("test_") or last == "conftest":
                    bad.append(f"{imp.where()} imports {t}")
    assert not bad, (
        "shared test helpers belong in _-prefixed helper modules (tests/_helpers.py, "
        "tests/_bits.py, a folder's _*.py), fixtures in conftest.py:\n" + "\n".join(bad)
    )


def test_core_tests_import_only_the_core() -> None:
    """``tests/core`` (and the helper modules it imports) imports no lowprec package but
    ``lowprec.core`` (and the facade ``lowprec`` for the core's public names)."""
    mods = all_test_modules()
    todo = [m for m in mods if m.startswith("tests.core.")]
    seen = set(todo)
    bad = []
    while todo:
        name = todo.pop()
        for imp in imports_of(mods[name], name):
            if imp.target.startswith("tests."):
                for t in resolve(imp.target, imp.names, mods):
                    if t not in seen:
                        seen.add(t)
                        todo.append(t)
            elif imp.target.startswith("lowprec.") and unit(imp.target) != "core/":
                bad.append(f"{imp.where()} imports {imp.target}")
    assert not bad, "\n".join(bad)
