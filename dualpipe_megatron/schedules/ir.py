"""Schedule IR: the per-rank op lists every other part of the project consumes.

A schedule is plain data. Generators build it, the validator checks it, the
simulator times it, the drawer plots it and the runtime executes it; the JSON
form is the public contract in ``docs/schedule_format.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Union


class ScheduleError(ValueError):
    """Bad input to a generator or a schedule that breaks the contract."""


@dataclass(frozen=True, order=True)
class Key:
    """One unit of pipeline work: micro-batch ``m`` at stage ``s`` of direction ``d``."""

    d: int
    s: int
    m: int

    def __str__(self) -> str:
        return f"(d={self.d},s={self.s},m={self.m})"


@dataclass(frozen=True)
class F:
    """Forward of ``key``."""

    key: Key

    def __str__(self) -> str:
        return f"F{self.key}"


@dataclass(frozen=True)
class B:
    """Backward of ``key``; ``w=False`` leaves the weight grad to a later :class:`W`."""

    key: Key
    w: bool = True

    def __str__(self) -> str:
        return f"B{self.key}" + ("" if self.w else "[w=false]")


@dataclass(frozen=True)
class W:
    """The deferred weight gradient of ``key``."""

    key: Key

    def __str__(self) -> str:
        return f"W{self.key}"


@dataclass(frozen=True)
class FB:
    """A forward and a backward run as one overlapped pair."""

    f: F
    b: B

    def __str__(self) -> str:
        return f"FB[{self.f}, {self.b}]"


Op = Union[F, B, W, FB]


def halves(op: Op) -> tuple[F | B | W, ...]:
    """The single ops an op is made of (an FB is its F and its B)."""
    return (op.f, op.b) if isinstance(op, FB) else (op,)


@dataclass
class Schedule:
    """Per-rank op lists plus the placement of every (direction, stage) on a rank."""

    name: str
    ranks: int
    stages: int
    microbatches: int
    directions: int
    ops: list[list[Op]]
    placement: dict[tuple[int, int], int] = field(default_factory=dict)

    @property
    def microbatches_per_direction(self) -> int:
        return self.microbatches // self.directions

    def rank_of(self, d: int, s: int) -> int:
        return self.placement[(d, s)]

    def stages_on(self, rank: int) -> list[tuple[int, int]]:
        """The (direction, stage) pairs held by ``rank``, in (d, s) order."""
        return sorted(ds for ds, r in self.placement.items() if r == rank)

    def iter_ops(self) -> Iterator[tuple[int, int, Op]]:
        for rank, rank_ops in enumerate(self.ops):
            for index, op in enumerate(rank_ops):
                yield rank, index, op

    # -- JSON contract -----------------------------------------------------
    def to_json_obj(self) -> dict[str, Any]:
        return {
            "schedule": self.name,
            "ranks": self.ranks,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "directions": self.directions,
            "ops": [[op_to_json(op) for op in rank_ops] for rank_ops in self.ops],
            "placement": [
                {"d": d, "s": s, "rank": r} for (d, s), r in sorted(self.placement.items())
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_json_obj())

    @classmethod
    def from_json_obj(cls, obj: dict[str, Any]) -> "Schedule":
        """Parse the contract form; placement is derived from F ops when absent."""
        try:
            ops = [[op_from_json(o) for o in rank_ops] for rank_ops in obj["ops"]]
            sched = cls(
                name=str(obj["schedule"]),
                ranks=int(obj["ranks"]),
                stages=int(obj["stages"]),
                microbatches=int(obj["microbatches"]),
                directions=int(obj["directions"]),
                ops=ops,
            )
        except (KeyError, TypeError) as exc:
            raise ScheduleError(f"malformed schedule JSON: {exc!r}") from exc
        if "placement" in obj:
            sched.placement = {(p["d"], p["s"]): p["rank"] for p in obj["placement"]}
        else:
            for rank, _, op in sched.iter_ops():
                for half in halves(op):
                    if isinstance(half, F):
                        sched.placement.setdefault((half.key.d, half.key.s), rank)
        return sched


def _key_json(key: Key) -> dict[str, int]:
    return {"d": key.d, "s": key.s, "m": key.m}


def op_to_json(op: Op) -> dict[str, Any]:
    if isinstance(op, F):
        return {"op": "F", **_key_json(op.key)}
    if isinstance(op, B):
        return {"op": "B", **_key_json(op.key), "w": op.w}
    if isinstance(op, W):
        return {"op": "W", **_key_json(op.key)}
    return {"op": "FB", "f": _key_json(op.f.key), "b": {**_key_json(op.b.key), "w": op.b.w}}


def _key_from(obj: dict[str, Any]) -> Key:
    return Key(int(obj["d"]), int(obj["s"]), int(obj["m"]))


def op_from_json(obj: dict[str, Any]) -> Op:
    kind = obj.get("op")
    if kind == "F":
        return F(_key_from(obj))
    if kind == "B":
        return B(_key_from(obj), bool(obj["w"]))
    if kind == "W":
        return W(_key_from(obj))
    if kind == "FB":
        return FB(F(_key_from(obj["f"])), B(_key_from(obj["b"]), bool(obj["b"]["w"])))
    raise ScheduleError(f"unknown op {obj!r}")
