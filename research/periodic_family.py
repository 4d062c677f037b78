"""How short a period can a repeating DualPipeV order have within an activation budget (issue 26)?
An exact answer over one family of orders, with no solver.

Run ``.venv/bin/python research/periodic_family.py [--ranks 4,8,16] [--periods 4.8,5.8] [--step 0.1]``;
not part of ``make test``. Costs: the "uniform F1 B2 W0.5 FB2.4" set of
``research/schedule_budget.py`` (F 1, B(w=false) 1.5, W 0.5, an F&B pair with a split backward 1.9).

The family: every rank runs one micro-batch's ops per period T in a fixed cyclic order: the F,
B(w=false) and W of each of its two stages (r and 2P - 1 - r), none, one or two of its F's each
run as an F&B pair with one of its B's, and the period's idle time (T less its work) in at most
two gaps; op starts on a grid of ``--step`` (every cost is a multiple of it). Micro-batch m runs
each op one period after micro-batch m - 1, and each op starts at its first slot on its rank
after its inputs are in (a pair's outputs leave when the pair ends).

Why it is exact over the family: an op's wait for its slot depends only on the cycles and the
phase offset of the two ranks of its hop. Neighbour ranks r and r + 1 share four hops (the V's
F and B each way), all shifted by the same offset, which no other hop depends on; so the least
wait of a link is a function of the two cycles alone. Stage 0's activation lives for the whole
round trip (every F, every B, then its W), so rank 0's two lifetimes are the sum of the ranks'
op times and of every link's wait: a dynamic program over the ranks finds the least. Their sum
over T is rank 0's average live count, a floor under its peak: where it is above K, no order of
the family with that period fits K. (The dynamic program does not bound the other ranks. Each
order it finds is checked against :func:`walk`, the chain followed op by op, which also gives
every rank's peak.)
"""

from __future__ import annotations

import argparse
import itertools
import math
from fractions import Fraction
from typing import NamedTuple

import numpy as np

from dualpipe_megatron.schedules.cli import markdown_table, positive_ints

OPS = ("Fa", "Fb", "Ba", "Bb", "Wa", "Wb")  # a: the rank's stage r, b: its stage 2P - 1 - r


class Durations(NamedTuple):
    """Op times in grid steps."""

    f: int
    b: int  # B(w=false)
    w: int
    pair: int  # an F and a B(w=false) as one op


class Cycle(NamedTuple):
    """One rank's ops in a period: each op's start and end offset (a pair's two ops share theirs)."""

    start: dict[str, int]
    end: dict[str, int]
    pairs: int


def cycles(d: Durations, period: int) -> list[Cycle]:
    """Every cyclic order of a rank's ops with 0, 1 or 2 pairs whose work fits the period, the
    idle time in at most two gaps (after any slot). The first slot is fixed (a rotation is the
    same cycle at another phase, which the links' offsets already cover)."""
    slot_sets = [[("Fa",), ("Fb",), ("Ba",), ("Bb",), ("Wa",), ("Wb",)]]
    for fx, by in itertools.product("ab", "ab"):
        other_f, other_b = "Fb" if fx == "a" else "Fa", "Bb" if by == "a" else "Ba"
        slot_sets.append([("F" + fx, "B" + by), (other_f,), (other_b,), ("Wa",), ("Wb",)])
    for by in "ab":
        slot_sets.append([("Fa", "B" + by), ("Fb", "B" + ("b" if by == "a" else "a")), ("Wa",), ("Wb",)])
    out = []
    for slots in slot_sets:
        for rest in itertools.permutations(slots[1:]):
            order = [slots[0], *rest]
            times = [d.pair if len(s) == 2 else d.f if s[0][0] == "F" else d.b if s[0][0] == "B" else d.w
                     for s in order]
            idle = period - sum(times)
            if idle < 0:
                continue
            for gaps in _gaps(idle, len(order)):
                start, end, t = {}, {}, 0
                for slot, time, gap in zip(order, times, gaps):
                    for op in slot:
                        start[op], end[op] = t, t + time
                    t += time + gap
                out.append(Cycle(start, end, sum(len(s) == 2 for s in order)))
    return out


def _gaps(idle: int, slots: int) -> set[tuple[int, ...]]:
    """Ways to leave ``idle`` after at most two of ``slots`` slots."""
    if idle == 0:
        return {(0,) * slots}
    out = set()
    for i in range(slots):
        for j in range(i, slots):
            for first in ([idle] if i == j else range(1, idle)):
                gaps = [0] * slots
                gaps[i] += first
                gaps[j] += idle - first
                out.add(tuple(gaps))
    return out


class Found(NamedTuple):
    lifetimes: int  # rank 0's two lifetimes, in grid steps
    cycles: list[Cycle]  # rank by rank
    offsets: list[int]  # each rank's phase


def least_rank0_lifetimes(ranks: int, period: int, d: Durations) -> Found:
    """The family's order with the least sum of rank 0's two lifetimes (stage 0's, stage 2P-1's),
    by dynamic programming over the ranks."""
    cyc = cycles(d, period)
    start = {op: np.array([c.start[op] for c in cyc]) for op in OPS}
    end = {op: np.array([c.end[op] for c in cyc]) for op in OPS}
    own = sum(end[op] - start[op] for op in ("Fa", "Fb", "Ba", "Bb"))  # the ranks' time on the round trip
    shift = np.arange(period)
    # link[i, j]: the least wait of the four hops between a rank in cycle i and the next in cycle j
    link = np.empty((len(cyc), len(cyc)), dtype=np.int64)
    best_shift = np.empty((len(cyc), len(cyc)), dtype=np.int64)
    for i in range(len(cyc)):
        wait = ((start["Fa"][:, None] + shift - end["Fa"][i]) % period  # F of stage r to r + 1
                + (start["Fb"][i] - end["Fb"][:, None] - shift) % period  # F of stage 2P-2-r to 2P-1-r
                + (start["Bb"][:, None] + shift - end["Bb"][i]) % period  # B of stage 2P-1-r to 2P-2-r
                + (start["Ba"][i] - end["Ba"][:, None] - shift) % period)  # B of stage r + 1 to r
        link[i], best_shift[i] = wait.min(axis=1), wait.argmin(axis=1)
    tip = (start["Fb"] - end["Fa"]) % period + (start["Ba"] - end["Bb"]) % period
    turn = (start["Bb"] - end["Fb"]) % period  # rank 0's wait from stage 2P-1's F to its B
    stage0_rest = turn + (start["Wa"] - end["Ba"]) % period + d.w  # beyond the links and ranks' op times
    last_stage = (end["Fb"] - start["Fb"]) + turn + (end["Bb"] - start["Bb"]) + (start["Wb"] - end["Bb"]) % period + d.w
    cost, back = stage0_rest + last_stage + own, []
    for _ in range(1, ranks):
        total = cost[:, None] + link
        back.append(total.argmin(axis=0))
        cost = total.min(axis=0) + own
    last = int(np.argmin(cost + tip))
    path = [last]
    for prev in reversed(back):
        path.append(int(prev[path[-1]]))
    path.reverse()
    offsets = [0]
    for a, b in zip(path, path[1:]):
        offsets.append((offsets[-1] + int(best_shift[a, b])) % period)
    return Found(int((cost + tip)[last]), [cyc[i] for i in path], offsets)


def walk(found: Found, period: int) -> tuple[list[int], list[int]]:
    """Follow one micro-batch's chain op by op through the found order, each op at its rank's
    first slot after its input: each stage's F start and W end."""
    ranks = len(found.cycles)
    stages = 2 * ranks

    def at(op: str, s: int, ready: int) -> tuple[int, int]:
        r = min(s, stages - 1 - s)
        c, which = found.cycles[r], op + ("a" if s < ranks else "b")
        phase = found.offsets[r] + c.start[which]
        begin = phase + math.ceil((ready - phase) / period) * period
        return begin, begin + c.end[which] - c.start[which]

    f_start, w_end, ready = [0] * stages, [0] * stages, 0
    for s in range(stages):
        f_start[s], ready = at("F", s, ready)
    for s in reversed(range(stages)):
        _, ready = at("B", s, ready)
        w_end[s] = at("W", s, ready)[1]
    return f_start, w_end


def peaks(f_start: list[int], w_end: list[int], period: int) -> list[int]:
    """Each rank's peak live count over the period, from :func:`walk`'s lifetimes."""
    stages = len(f_start)
    return [max(sum((t - f_start[s]) // period - (t - w_end[s]) // period for s in (r, stages - 1 - r))
                for t in range(period)) for r in range(stages // 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=positive_ints, default=(4, 8, 16))
    parser.add_argument("--periods", default="4.8,5.4,5.6,5.7,5.8,6")
    parser.add_argument("--step", default="0.1", help="the grid of op starts (every cost a multiple of it)")
    args = parser.parse_args()
    step = Fraction(args.step)
    d = Durations(*(int(Fraction(x) / step) for x in ("1", "1.5", "0.5", "1.9")))
    rows = []
    for p in args.ranks:
        cap = math.ceil(3 * (2 * p + 1) / 4)  # 3/4 of DeepSeek's peak of 2P + 1
        for text in args.periods.split(","):
            period = int(Fraction(text) / step)
            found = least_rank0_lifetimes(p, period, d)
            f_start, w_end = walk(found, period)
            assert w_end[0] - f_start[0] + w_end[-1] - f_start[-1] == found.lifetimes  # links and chain agree
            rows.append([str(p), str(cap), text, f"{found.lifetimes / period:.2f}",
                         "yes" if found.lifetimes <= cap * period else "no", str(max(peaks(f_start, w_end, period))),
                         str(sum(c.pairs for c in found.cycles))])
            print(" ".join(rows[-1]), flush=True)
    print(markdown_table(["P", "K", "period", "rank 0's least average live", "within K", "that order's peak",
                          "its pairs per micro-batch"], rows))


if __name__ == "__main__":
    main()
