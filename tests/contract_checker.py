"""An independent reading of docs/schedule_format.md, used only by tests.

It checks a schedule's JSON without the package's validator, so a bug shared
by a generator and the validator cannot hide.
"""

from __future__ import annotations

from collections import defaultdict

KEYS = {"F": {"op", "d", "s", "m"}, "B": {"op", "d", "s", "m", "w"}, "W": {"op", "d", "s", "m"},
        "FB": {"op", "f", "b"}}


def _singles(op: dict) -> list[tuple[str, tuple[int, int, int], bool | None]]:
    assert set(op) == KEYS[op["op"]], f"bad keys in {op}"
    if op["op"] == "FB":
        assert set(op["f"]) == {"d", "s", "m"} and set(op["b"]) == {"d", "s", "m", "w"}, op
        return [("F", (op["f"]["d"], op["f"]["s"], op["f"]["m"]), None),
                ("B", (op["b"]["d"], op["b"]["s"], op["b"]["m"]), op["b"]["w"])]
    return [(op["op"], (op["d"], op["s"], op["m"]), op.get("w"))]


def check(doc: dict) -> None:
    """Raise AssertionError when ``doc`` breaks any rule of the contract."""
    for k in ("schedule", "ranks", "stages", "microbatches", "directions", "ops"):
        assert k in doc, f"missing top-level key {k}"
    P, S, D = doc["ranks"], doc["stages"], doc["directions"]
    assert len(doc["ops"]) == P and doc["microbatches"] % D == 0
    per_dir = doc["microbatches"] // D
    count: dict[tuple, int] = defaultdict(int)
    home: dict[tuple[int, int], set[int]] = defaultdict(set)
    deferred = set()
    for rank, ops in enumerate(doc["ops"]):
        for op in ops:
            for kind, (d, s, m), w in _singles(op):
                assert 0 <= d < D and 0 <= s < S and 0 <= m < per_dir, op
                count[(kind, d, s, m)] += 1
                home[(d, s)].add(rank)
                if kind == "B" and w is False:
                    deferred.add((d, s, m))
    for d in range(D):
        for s in range(S):
            assert len(home[(d, s)]) == 1, f"stage {(d, s)} on ranks {home[(d, s)]}"
            for m in range(per_dir):
                assert count[("F", d, s, m)] == 1 and count[("B", d, s, m)] == 1, (d, s, m)
                assert count[("W", d, s, m)] == (1 if (d, s, m) in deferred else 0), (d, s, m)
    # Placement rules the contract fixes for the two DualPipe schedules.
    if doc["schedule"] == "dualpipev":
        assert S == 2 * P
        for s in range(S):
            assert home[(0, s)] == {s if s < P else 2 * P - 1 - s}
    if doc["schedule"] == "dualpipe":
        assert S == P and D == 2
        for s in range(S):
            assert home[(0, s)] == {s} and home[(1, s)] == {P - 1 - s}
    _check_runs(doc["ops"], S)


def _check_runs(all_ops: list[list[dict]], stages: int) -> None:
    """Execute in order, one op at a time per rank, until every rank is done or stuck."""
    done: set[tuple] = set()
    pos = [0] * len(all_ops)

    def ready(op: dict) -> bool:
        parts = _singles(op)
        own = {(k, key) for k, key, _ in parts}
        for kind, (d, s, m), _ in parts:
            if kind == "F":
                need = [("F", (d, s - 1, m))] if s else []
            elif kind == "B":
                need = [("F", (d, s, m))] + ([("B", (d, s + 1, m))] if s + 1 < stages else [])
            else:
                need = [("B", (d, s, m))]
            if any(n not in done and n not in own for n in need):
                return False
            if kind == "B" and ("F", (d, s, m)) in own:
                return False  # an FB cannot backward its own forward
        return True

    moved = True
    while moved:
        moved = False
        for r, ops in enumerate(all_ops):
            if pos[r] < len(ops) and ready(ops[pos[r]]):
                done.update((k, key) for k, key, _ in _singles(ops[pos[r]]))
                pos[r] += 1
                moved = True
    stuck = [r for r, ops in enumerate(all_ops) if pos[r] < len(ops)]
    assert not stuck, f"deadlock or broken dependency on ranks {stuck}"
