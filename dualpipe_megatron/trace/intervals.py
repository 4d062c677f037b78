"""Interval arithmetic for GPU timelines: unions, intersections and differences of [start, end) spans.

Busy time on a stream, compute and communication time on a GPU, hidden and
exposed communication are all lengths of such sets; kernels on different
streams overlap, so their durations cannot simply be added.
"""

from __future__ import annotations

from typing import Iterable

Span = tuple[float, float]


def union(spans: Iterable[Span]) -> list[Span]:
    """Disjoint, sorted spans covering exactly the given ones (empty spans dropped)."""
    out: list[Span] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def length(spans: Iterable[Span]) -> float:
    """Total length of disjoint spans."""
    return sum(end - start for start, end in spans)


def intersect(a: list[Span], b: list[Span]) -> list[Span]:
    """The part of disjoint sorted spans ``a`` also covered by disjoint sorted spans ``b``."""
    out: list[Span] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Span], b: list[Span]) -> list[Span]:
    """The part of disjoint sorted spans ``a`` not covered by disjoint sorted spans ``b``."""
    out: list[Span] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if start < end:
            out.append((start, end))
    return out


def clip(spans: list[Span], start: float, end: float) -> list[Span]:
    """Disjoint sorted ``spans`` cut to [start, end)."""
    return intersect(spans, [(start, end)]) if end > start else []


__all__ = ["Span", "clip", "intersect", "length", "subtract", "union"]
