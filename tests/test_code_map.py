"""docs/README.md's code map names every module of the package, in the row of its folder.

A module missing from the map is invisible to a new reader; one named but gone misleads.
"""

from __future__ import annotations

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
