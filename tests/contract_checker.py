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
    if "programs" in doc:
        _check_programs(doc)


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


def _feeds(a: tuple, b: tuple) -> bool:
    """Whether single op ``a``'s output (activations, or input grads) is an input of single op ``b``."""
    (ka, (d, s, m), _), (kb, key_b, _) = a, b
    return ((ka, kb) == ("F", "F") and key_b == (d, s + 1, m)) or ((ka, kb) == ("B", "B") and key_b == (d, s - 1, m))


def _check_programs(doc: dict) -> None:
    """The per-rank programs: each rank runs its ops in order, and its posts carry exactly the
    cross-rank inputs, matched in order per pair, posted and waited where the ops need them."""
    forward_only = doc.get("forward_only", False)
    assert isinstance(forward_only, bool), "forward_only must be a boolean"
    programs = doc["programs"]
    assert set(programs) == {str(r) for r in range(len(doc["ops"]))}, f"program ranks {sorted(programs)}"
    runs: dict[int, list[dict]] = {}
    sends: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # (src, dst) -> producing ops, in post order
    recvs: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # (src, dst) -> needing ops, in post order
    for rank, ops in enumerate(doc["ops"]):
        want = [(i, op) for i, op in enumerate(ops) if not forward_only or op["op"] in ("F", "FB")]
        want = [(i, op["f"] | {"op": "F"} if forward_only and op["op"] == "FB" else op) for i, op in want]
        events = programs[str(rank)]
        runs[rank] = [e for e in events if "run" in e]
        assert [(e["run"], e["op"]) for e in runs[rank]] == want, f"rank {rank}: the runs are not its ops in order"
        posted: dict[int, tuple] = {}  # id -> (kind, peer, index of the run before it)
        waited: dict[int, int] = {}  # id -> index of the run after its wait
        done = 0
        for e in events:
            if "run" in e:
                done += 1
            elif "post" in e:
                assert e["post"] in ("send", "recv") and e["id"] not in posted and e["peer"] != rank, e
                assert 0 <= e["peer"] < len(doc["ops"]), e
                posted[e["id"]] = (e["post"], e["peer"], done - 1)
            else:
                assert set(e) == {"wait", "what"} and all(i in posted and i not in waited for i in e["wait"]), e
                waited.update((i, done) for i in e["wait"])
        assert waited.keys() == posted.keys(), f"rank {rank}: posts never waited for"
        for ident, (kind, peer, before) in posted.items():
            if kind == "send":
                assert before >= 0, f"rank {rank}: a send before any op ran"
                sends[(rank, peer)].append(runs[rank][before]["op"])
            else:
                assert waited[ident] < len(runs[rank]), f"rank {rank}: a receive no op needs"
                recvs[(peer, rank)].append(runs[rank][waited[ident]]["op"])
    home = {(k, key): rank for rank, ops in runs.items() for op in ops for k, key, _ in _singles(op["op"])}
    expected = set()  # (producer, consumer) single ops on different ranks
    for (k, (d, s, m)), rank in home.items():
        if k in ("F", "B"):
            producer = (k, (d, s - 1, m) if k == "F" else (d, s + 1, m))
            if home.get(producer, rank) != rank:
                expected.add((producer, (k, (d, s, m))))
    covered = set()
    matched = 0
    for pair in set(sends) | set(recvs):
        assert len(sends[pair]) == len(recvs[pair]), f"pair {pair}: sends and receives differ in number"
        for made, used in zip(sends[pair], recvs[pair]):  # NCCL matches a pair's messages in order
            found = {((a[0], a[1]), (b[0], b[1])) for a in _singles(made) for b in _singles(used)
                     if _feeds(a, b)}
            assert found, f"pair {pair}: a message from {made} is received for {used}, which does not need it"
            covered |= found
            matched += 1
    assert covered == expected and matched == len(expected), (
        f"{matched} messages cover {len(covered)} of {len(expected)} cross-rank inputs")
