"""The schedules DualPipe is measured against: 1F1B, ZB-H1 and Megatron's interleaved 1F1B."""

from __future__ import annotations

from .ir import B, F, Key, Op, Schedule, ScheduleError, W


def _check_ranks_microbatches(name: str, ranks: int, microbatches: int) -> None:
    if ranks < 1:
        raise ScheduleError(f"{name} needs at least 1 rank, got {ranks}")
    if microbatches < 1:
        raise ScheduleError(f"{name} needs at least 1 microbatch, got {microbatches}")


def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """Megatron's non-interleaved 1F1B: rank ``r`` warms up with ``P-r-1`` forwards."""
    _check_ranks_microbatches("1f1b", ranks, microbatches)
    ops: list[list[Op]] = []
    for r in range(ranks):
        warm = min(ranks - r - 1, microbatches)
        rank_ops: list[Op] = [F(Key(0, r, m)) for m in range(warm)]
        for m in range(microbatches - warm):
            rank_ops += [F(Key(0, r, m + warm)), B(Key(0, r, m))]
        rank_ops += [B(Key(0, r, m)) for m in range(microbatches - warm, microbatches)]
        ops.append(rank_ops)
    placement = {(0, s): s for s in range(ranks)}
    return Schedule("1f1b", ranks, ranks, microbatches, 1, ops, placement)


def zb1p(ranks: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., arXiv 2401.10241): 1F1B with input-grad-only backwards.

    Rank ``r`` keeps 1F1B's warm-up, then defers the weight grads of its first
    ``r`` steady-state backwards; the deferred W's fill the cool-down waits, so
    the bubble shrinks to ``(P-1)(F+B-2W)`` while peak activations stay at ``P``.
    """
    _check_ranks_microbatches("zb1p", ranks, microbatches)
    ops: list[list[Op]] = []
    for r in range(ranks):
        warm = min(ranks - r - 1, microbatches)
        rank_ops: list[Op] = [F(Key(0, r, m)) for m in range(warm)]
        pending: list[Key] = []
        for m in range(microbatches):
            if m + warm < microbatches:
                rank_ops.append(F(Key(0, r, m + warm)))
            key = Key(0, r, m)
            rank_ops.append(B(key, w=False))
            pending.append(key)
            # Hold back r weight grads for the tail; release the rest at once.
            if len(pending) > r:
                rank_ops.append(W(pending.pop(0)))
        rank_ops += [W(k) for k in pending]
        ops.append(rank_ops)
    placement = {(0, s): s for s in range(ranks)}
    return Schedule("zb1p", ranks, ranks, microbatches, 1, ops, placement)


def megatron_interleaved_table(
    microbatches: int, chunks: int, group_size: int
) -> list[tuple[int, int]]:
    """Megatron's virtual-microbatch table: (micro-batch, chunk) pairs in forward order.

    Micro-batches go through each chunk in groups of ``group_size``
    (``microbatch_group_size_per_vp_stage``, Megatron's default is ``P``).
    """
    table: list[tuple[int, int]] = []
    for start in range(0, microbatches, group_size):
        end = microbatches if start + group_size >= microbatches else start + group_size
        table += [(m, c) for c in range(chunks) for m in range(start, end)]
    return table


def interleaved(
    ranks: int, microbatches: int, chunks: int = 2, group_size: int | None = None
) -> Schedule:
    """Megatron's interleaved 1F1B: ``v`` chunks per rank, stage ``c*P + r`` on rank ``r``."""
    _check_ranks_microbatches("interleaved", ranks, microbatches)
    if chunks < 2:
        raise ScheduleError(f"interleaved needs chunks >= 2, got {chunks}")
    group = ranks if group_size is None else group_size
    if not ranks <= group <= microbatches:
        raise ScheduleError(
            f"interleaved needs ranks ({ranks}) <= group size ({group}) <= microbatches "
            f"({microbatches}), as Megatron's microbatch_group_size_per_vp_stage"
        )
    remainder = microbatches % group
    if 0 < remainder < ranks:
        raise ScheduleError(
            f"interleaved: microbatches ({microbatches}) mod group size ({group}) is "
            f"{remainder}; Megatron requires 0 or >= ranks ({ranks})"
        )
    table = megatron_interleaved_table(microbatches, chunks, group)
    total = len(table)
    ops: list[list[Op]] = []
    for r in range(ranks):
        warm = min((ranks - r - 1) * 2 + (chunks - 1) * group, total)

        def fwd(k: int) -> F:
            m, c = table[k]
            return F(Key(0, c * ranks + r, m))

        def bwd(k: int) -> B:
            m, c = table[k]
            return B(Key(0, (chunks - 1 - c) * ranks + r, m))

        rank_ops: list[Op] = [fwd(k) for k in range(warm)]
        for k in range(total - warm):
            rank_ops += [fwd(k + warm), bwd(k)]
        rank_ops += [bwd(k) for k in range(total - warm, total)]
        ops.append(rank_ops)
    stages = ranks * chunks
    placement = {(0, s): s % ranks for s in range(stages)}
    return Schedule("interleaved", ranks, stages, microbatches, 1, ops, placement)
