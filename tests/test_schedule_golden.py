"""Our DualPipe/DualPipeV op lists equal DeepSeek's, op for op.

The golden lists in tests/data/deepseek_golden_ops.json were recorded from DeepSeek's own
``step()`` by scripts/derive_deepseek_reference.py (which needs a DualPipe checkout; this
test does not). Regenerate them with that script.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
GOLDEN = json.loads((REPO / "tests" / "data" / "deepseek_golden_ops.json").read_text())
_spec = importlib.util.spec_from_file_location("derive_deepseek_reference",
                                               REPO / "scripts" / "derive_deepseek_reference.py")
derive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(derive)


def _case_id(case: dict) -> str:
    return f"{case['schedule']}-P{case['ranks']}-M{case['microbatches']}"


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=_case_id)
def test_op_lists_equal_deepseek(case: dict) -> None:
    theirs = [rank_ops.split() for rank_ops in case["ops"]]
    name, ranks, m = case["schedule"], case["ranks"], case["microbatches"]
    difference = derive.first_difference(name, ranks, m, theirs)
    assert difference is None, difference


def test_golden_grid() -> None:
    """The stored grid is the script's; it has P 2, 4, 6, 8 at 2P, 3P and a non-multiple of P."""
    stored = {(c["schedule"], c["ranks"], c["microbatches"]) for c in GOLDEN["cases"]}
    assert stored == {c for c in derive.cases() if derive.stored_golden(c[1], c[2])}
    for p in (2, 4, 6, 8):
        for m in (2 * p, 3 * p, 2 * p + 2):
            assert ("dualpipe", p, m) in stored and ("dualpipev", p, m) in stored
        assert ("dualpipev", p, 2 * p + 1) in stored
    assert len(GOLDEN["meta"]["commit"]) == 40


def test_a_difference_is_named() -> None:
    """Swapping two ops of DeepSeek's list is reported at the first of them."""
    case = next(c for c in GOLDEN["cases"] if _case_id(c) == "dualpipev-P4-M8")
    theirs = [rank_ops.split() for rank_ops in case["ops"]]
    theirs[2][5], theirs[2][6] = theirs[2][6], theirs[2][5]
    ours_5 = case["ops"][2].split()[5]
    assert derive.first_difference("dualpipev", 4, 8, theirs) == (
        f"dualpipev P=4 M=8 rank 2 op 5: ours {ours_5}, DeepSeek's {theirs[2][5]}")
    assert derive.first_difference("dualpipev", 4, 8, theirs[:3]) == (
        "dualpipev P=4 M=8: 4 ranks, DeepSeek's 3")
