"""docs/README.md's code map names every module of the package, in the row of its folder.

A module missing from the map is invisible to a new reader; one named but gone misleads.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dualpipe_megatron"
MAP_HEADING = "## Where the code is"


def _rows() -> dict[str, str]:
    """Code-map rows by the folder (``dualpipe_megatron/x/``) or top-level module path they open with."""
    text = (ROOT / "docs" / "README.md").read_text()
    assert MAP_HEADING in text, "docs/README.md lost its code map"
    rows: dict[str, str] = {}
    for line in text.split(MAP_HEADING, 1)[1].splitlines():
        match = re.match(r"\| `(dualpipe_megatron/[^`]*)`(.*)", line)
        if match:
            rows[match.group(1)] = match.group(0)
    return rows


def _modules() -> list[Path]:
    """Every module a reader would look for: packages' ``__init__`` and ``__main__`` aside."""
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))


@pytest.mark.parametrize("module", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_is_in_the_code_map(module: Path) -> None:
    rows = _rows()
    relative = module.relative_to(ROOT).as_posix()
    if module.parent == PACKAGE:  # top-level module: its own row, or named in a top-level row
        named = [row for key, row in rows.items() if key.count("/") == 1 and f"`{module.name}`" in row
                 or key == relative]
    else:
        folder = module.parent.relative_to(ROOT).as_posix() + "/"
        named = [rows[folder]] if folder in rows and f"`{module.name}`" in rows[folder] else []
    assert named, f"docs/README.md's code map does not name {relative}"


def test_the_code_map_names_no_missing_module() -> None:
    gone = []
    for key, row in _rows().items():
        folder = ROOT / key if key.endswith("/") else (ROOT / key).parent
        for name in re.findall(r"`([a-z_0-9]+\.py)`", row):
            if not (folder / name).exists():
                gone.append(f"{key}: {name}")
    assert not gone, f"the code map names modules that do not exist: {gone}"


STATE_HEADING = "## Module-level state"
MUTATING = ("append", "extend", "add", "update", "pop", "clear", "setdefault", "remove", "insert", "discard")
CONTAINERS = ("dict", "list", "set", "defaultdict", "OrderedDict", "WeakKeyDictionary", "WeakValueDictionary")


def _is_container(value: ast.expr | None) -> bool:
    return isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) or (
        isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in CONTAINERS)


def _mutated(tree: ast.Module, name: str) -> bool:
    """Whether the module changes ``name``'s container (item assignment, a mutating method, ``global``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Global) and name in node.names:
            return True
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            if any(isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == name
                   for t in targets):
                return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING
                and isinstance(node.func.value, ast.Name) and node.func.value.id == name):
            return True
    return False


def module_state() -> set[tuple[str, str]]:
    """(module path, name) of every module-level container its module mutates."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and _is_container(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found |= {(path.relative_to(ROOT).as_posix(), t.id) for t in targets
                          if isinstance(t, ast.Name) and _mutated(tree, t.id)}
    return found


def test_module_level_state_is_listed_and_does_not_grow() -> None:
    text = (ROOT / "docs" / "README.md").read_text()
    assert STATE_HEADING in text, "docs/README.md lost its list of module-level state"
    listed = set(re.findall(r"^\| `(dualpipe_megatron/[^`]+)` \| `(\w+)` \|", text.split(STATE_HEADING, 1)[1], re.M))
    found = module_state()
    assert found - listed == set(), "module-level state missing from docs/README.md"
    assert listed - found == set(), "docs/README.md lists module-level state that is gone"
    assert len(found) <= 13, "more module-level state than the 13 entries this list started with"
