"""The pipeline ranks share the op-order search instead of each running all of it.

Every rank of a job with an optimized order (``--dualpipe-optimize-order``,
``--dualpipe-max-activations``) needs the same order, and the search is deterministic, so each
rank could run the whole of it; at P = 16, M = 128 under a budget that is seconds of CPU on
every rank, all at once. The search's pieces (list schedules, local searches, exact checks) are
independent (:class:`~dualpipe_megatron.schedules.optimize.Workers`): here rank r runs pieces r,
r + P, ... and an all-gather gives every rank every result, so every rank ends with the order one
process alone would find. The collectives run while the plan is built, before any pipeline
message, in the same sequence on every rank: the search's control flow depends only on its
inputs, which the ranks compare first.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .agreement import PlanMismatchError


def all_gather_pickled(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``obj``, by rank: torch's ``all_gather_object`` method (pickle, gather the
    lengths, gather the bytes padded to the longest), but the padded bytes are copied into a
    fresh zeroed tensor. ``all_gather_object`` resizes a tensor made on the pickle's own buffer
    in place, and gloo gathered such a tensor about 6x slower: with 16 ranks on this machine's
    2 cores, 100 KB from one rank took 750 ms a gather against 115 ms (the results of the
    search's pieces are orders of about that size)."""
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == dist.Backend.NCCL else torch.device("cpu"))
    data = pickle.dumps(obj)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(group.size())]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in lengths]
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    every = torch.empty(longest * group.size(), dtype=torch.uint8, device=device)
    dist.all_gather(list(every.split(longest)), mine, group=group)
    raw = every.cpu().numpy().tobytes()
    return [pickle.loads(raw[r * longest:r * longest + size]) for r, size in enumerate(sizes)]


class SearchFailedError(RuntimeError):
    """A piece of the shared search raised on some rank (raised on every rank)."""


class RankWorkers:
    """The ranks of ``group`` as the optimizer's workers. Construction is a collective: it
    raises :class:`~.agreement.PlanMismatchError` on every rank unless all ranks search from the
    same ``inputs`` (named parts, compared by digest), since ranks with other inputs would run
    other collectives and hang."""

    def __init__(self, group: dist.ProcessGroup, inputs: dict[str, str]) -> None:
        self.group, self.count, self.rank = group, group.size(), group.rank()
        mine = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in inputs.items()}
        every = all_gather_pickled(mine, group)
        odd = [r for r, theirs in enumerate(every) if theirs != every[0]]
        if odd:
            parts = sorted(name for name in every[0] if every[odd[0]].get(name) != every[0][name])
            raise PlanMismatchError(
                f"pipeline ranks {odd} would optimize the op order from other inputs than rank 0 "
                f"(rank {odd[0]} differs in: {', '.join(parts) or 'the inputs named'}): every rank "
                f"needs the same flags and the same --dualpipe-stage-costs file")

    def map(self, fn: Callable[[Any], Any], tasks: Sequence[Any]) -> list[Any]:
        """Run this rank's tasks, then all-gather every result; a failure on any rank raises
        :class:`SearchFailedError` on every rank (after the gather, so that none is left waiting)."""
        mine: dict[int, Any] = {}
        failure: BaseException | None = None
        for i in range(self.rank, len(tasks), self.count):
            try:
                mine[i] = fn(tasks[i])
            except Exception as exc:  # the other ranks wait in the gather below: reach it
                failure = exc
                break
        every = all_gather_pickled((mine, None if failure is None else f"{type(failure).__name__}: {failure}"),
                                   self.group)
        failed = [(rank, said) for rank, (_, said) in enumerate(every) if said is not None]
        if failed:
            rank, said = failed[0]
            raise SearchFailedError(f"the op-order search failed on pipeline rank {rank}: {said}") from failure
        merged = {i: result for got, _ in every for i, result in got.items()}
        return [merged[i] for i in range(len(tasks))]


__all__ = ["RankWorkers", "SearchFailedError", "all_gather_pickled"]
