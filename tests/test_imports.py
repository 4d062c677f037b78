"""The package's import structure: every module imports on its own, no import cycles, layers.

Cycles are found statically from every ``import`` statement, including the ones inside
functions (a lazy import hides a cycle from a single import test but not from a reader):
between modules, and between sub-packages (each top-level module counts as one), where
``megatron`` and ``eplb`` once imported each other through a lazy import.

The sub-packages form layers, lowest first; a layer imports only from layers below it:

1. ``schedules`` (the schedule IR and its tools) and ``patch_guard``: no other sub-package;
2. ``runtime``: the executor, p2p, strict mode;
3. ``compat`` (DeepSeek's API) and ``trace``: clients of the runtime;
4. ``megatron`` (the adapter, which records traces) and ``projection``;
5. ``eplb``: hooks into the adapter's argument hooks and gradient path; ``bridge``:
   Megatron-Bridge's route, over the adapter;
6. entry points, which may also import one another: ``routes`` (above ``megatron`` and
   ``eplb``), ``launch``, ``plan`` (and ``launch_plan``, its first command name), ``demo``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import dualpipe_megatron

pytestmark = pytest.mark.multiprocess

PACKAGE = Path(dualpipe_megatron.__file__).parent
SKIP = {"dualpipe_megatron.__main__"}
LAYERS = [
    {"", "schedules", "patch_guard"},  # "": the package's own __init__
    {"runtime"},
    {"compat", "trace"},
    {"megatron", "projection"},
    {"eplb", "bridge"},
    {"routes", "launch", "plan", "launch_plan", "demo"},
]
ENTRY_POINTS = LAYERS[-1]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules ``name`` imports anywhere in its source (resolved, ``__init__`` included)."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                root = ".".join(base[:len(base) - node.level + 1])
                module = f"{root}.{node.module}" if node.module else root
            else:
                module = node.module or ""
            targets.add(module)
            targets |= {f"{module}.{alias.name}" for alias in node.names}
    return {t for t in targets if t in modules and t != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # A package importing its own submodules (to re-export them) is not a cycle with them.
    for name in graph:
        graph[name] = {t for t in graph[name] if not (name and t.startswith(name + "."))}
    return graph


def _part(module: str) -> str:
    """The sub-package (or top-level module) ``module`` belongs to; "" for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _sub_package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` collapsed onto sub-packages: A -> B when any module of A imports one of B."""
    collapsed: dict[str, set[str]] = {}
    for module, targets in graph.items():
        collapsed.setdefault(_part(module), set()).update(_part(t) for t in targets)
    return {part: targets - {part} for part, targets in collapsed.items()}


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_no_import_cycles_between_sub_packages() -> None:
    assert _cycles(_sub_package_graph(_graph())) == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_cycle_through_lazy_imports_of_two_sub_packages_is_found() -> None:
    """Module-level acyclic (x -> y, z -> w) but a cycle between sub-packages ``a`` and ``b``."""
    graph = {"p.a.x": {"p.b.y"}, "p.b.y": set(), "p.b.z": {"p.a.w"}, "p.a.w": set()}
    assert _cycles(graph) == []
    assert _cycles(_sub_package_graph(graph)) == [["a", "b"]]


def test_sub_packages_import_only_lower_layers() -> None:
    layer = {part: i for i, parts in enumerate(LAYERS) for part in parts}
    graph = _sub_package_graph(_graph())
    assert sorted(set(graph) - set(layer)) == [], "place every sub-package in LAYERS"
    upward = sorted(f"{part} -> {target}" for part, targets in graph.items() if part
                    for target in targets if layer[target] >= layer[part]
                    and not (part in ENTRY_POINTS and target in ENTRY_POINTS))
    assert upward == [], "imports against the layer order (see this module's docstring)"


def test_every_module_imports_first() -> None:
    """In a fresh interpreter, each module is imported with none of the package loaded before it
    (third-party imports stay cached, so this takes seconds, not one interpreter per module)."""
    names = [n for n in _modules() if n not in SKIP and not n.endswith("__main__")]
    script = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] == 'dualpipe_megatron']:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
    )
    run = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
