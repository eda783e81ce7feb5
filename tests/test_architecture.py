"""The house rules of docs/architecture.md, checked on the real source tree.

Every ``autotune`` import (module level or inside a function) is read with :mod:`ast`; a module may
import only modules of its own layer or lower ones, the import graph has no cycle, no module grows
past the size a reader can hold, and few modules sit flat in ``autotune/``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"

# Lowest layer first; a module belongs to the first prefix that matches it (longest prefixes are
# listed where a package spans layers: the flat autotune package holds modules of every layer).
LAYERS: list[tuple[int, tuple[str, ...]]] = [
    (0, ("autotune", "autotune.errors", "autotune.units", "autotune.files", "autotune.pyparse")),
    (1, ("autotune.recipe", "autotune.hardware", "autotune.nvml", "autotune.models")),
    (2, ("autotune.candidate", "autotune.trial")),
    (3, ("autotune.configs",)),
    (4, ("autotune.runners", "autotune.worker", "autotune.study", "autotune.sim", "autotune.progress")),
    (
        5,
        (
            "autotune.search.planner",
            "autotune.search.policy",
            "autotune.search.pruning",
            "autotune.search.stopping",
            "autotune.search.parallel",
            "autotune.search.state",
            "autotune.search",
            "autotune.export",
        ),
    ),
    (6, ("autotune.search.loop", "autotune.search.confirm", "autotune.production")),
    (7, ("autotune.commands", "autotune.doctor")),
    (8, ("autotune.cli", "autotune.__main__")),
]
MAX_LINES = 420
MAX_FLAT_MODULES = 12


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(name: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for level, prefixes in LAYERS:
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), level)
    assert best is not None, f"{name} is in no layer: add it to LAYERS and docs/architecture.md"
    return best[1]


def imports(name: str) -> set[str]:
    """The autotune modules ``name`` imports, resolved to modules that exist."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from autotune.candidate import constraints` imports a module, not a name
            targets = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: imports(name) for name in MODULES}


def test_every_module_has_a_layer():
    for name in MODULES:
        layer(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_a_higher_layer(name):
    higher = sorted(t for t in GRAPH[name] if layer(t) > layer(name))
    assert not higher, f"{name} (layer {layer(name)}) imports higher layers: {higher}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as the path that closes it, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name)
            if found:
                return found
    return None


def package(name: str) -> str:
    """``autotune.search.loop`` -> ``autotune.search``; a flat module is its own package."""
    return ".".join(name.split(".")[:2])


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_two_packages_import_each_other():
    """Packages form a stack too: runners may not import search while search imports runners, even
    when no two modules close a circle (that hid runners <-> search and export <-> search)."""
    packages: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        packages.setdefault(package(name), set()).update(
            package(t) for t in targets if package(t) != package(name)
        )
    cycle = find_cycle(packages)
    assert cycle is None, "package import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles():
    """The checks above cannot pass by a finder that sees nothing."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_modules_stay_small_and_few_sit_flat():
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    assert not {n: k for n, k in long.items() if k > MAX_LINES}, "split these modules by job"
    flat = [p.name for p in PACKAGE.glob("*.py")]
    assert len(flat) <= MAX_FLAT_MODULES, f"{len(flat)} modules flat in autotune/: {sorted(flat)}"


def test_the_checker_sees_real_imports():
    """The graph is not empty by accident: known edges are there."""
    assert "autotune.trial.execute" in GRAPH["autotune.runners.base"]
    assert "autotune.candidate.constraints" in GRAPH["autotune.search.policy"]
    assert layer("autotune.search.loop") > layer("autotune.candidate.space")


# docs/ of this repository is flat: "peft's docs/source/accelerate/deepspeed.md" or a URL's path
# names another project's page
DOC_CITATION = re.compile(r"(?<![\w./-])docs/[\w.-]+\.md")


def test_every_cited_docs_page_exists():
    """A module that sends its reader to a docs/ page sends them somewhere that exists."""
    cited = {
        (match.group(0), name)
        for name, path in MODULES.items()
        for match in DOC_CITATION.finditer(path.read_text())
    }
    assert cited, "the checker finds no citation at all: the pattern is wrong"
    missing = sorted((page, name) for page, name in cited if not (PACKAGE.parent / page).is_file())
    assert not missing, f"cited docs pages that do not exist: {missing}"


def test_no_module_cites_the_founding_design_document():
    """DESIGN.md was never part of the repository: the trial contract is docs/trial-contract.md."""
    citing = sorted(name for name, path in MODULES.items() if "DESIGN.md" in path.read_text())
    assert not citing, f"these modules cite DESIGN.md, which the repository does not hold: {citing}"


def test_every_parse_of_python_text_goes_through_the_lock():
    """CPython 3.11's ``ast.parse`` breaks when two threads run it at once (autotune/pyparse.py):
    a module that calls it directly, or ``compile`` or ``ast.literal_eval`` (which parse too), brings
    back the crash CI saw in a parallel search."""
    direct = []
    for name, path in MODULES.items():
        if name == "autotune.pyparse":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                owner = (
                    func.value.id
                    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                    else ""
                )
                if (owner, called) in {("ast", "parse"), ("ast", "literal_eval"), ("", "compile")}:
                    direct.append(f"{name}:{node.lineno}")
            elif isinstance(node, ast.ImportFrom) and node.module == "ast":
                if {a.name for a in node.names} & {"parse", "literal_eval", "*"}:
                    direct.append(f"{name}:{node.lineno} (from ast import ...)")
            elif isinstance(node, ast.Import):
                if any(a.name == "ast" and a.asname not in (None, "ast") for a in node.names):
                    direct.append(f"{name}:{node.lineno} (ast imported under another name)")
    assert not direct, f"parse through autotune.pyparse.parse: {direct}"


TESTS = Path(__file__).resolve().parent


def imports_of(path: Path) -> set[str]:
    """The modules one test file imports (module level or inside a function), as written."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def test_no_test_module_imports_another():
    """A helper two topics share lives in conftest.py: a test module that imports another one runs
    (and re-collects) that module's tests from a second place, and ties two topics together."""
    own = {path.stem for path in TESTS.glob("test_*.py")}
    crossing = {
        path.name: sorted(m for m in imports_of(path) if m in own or m.startswith("tests."))
        for path in sorted(TESTS.glob("*.py"))
    }
    crossing = {name: mods for name, mods in crossing.items() if mods}
    assert not crossing, f"import these helpers from conftest instead: {crossing}"
    assert {"conftest", "pytest"} <= imports_of(TESTS / "test_vl.py"), "the reader sees no imports"
