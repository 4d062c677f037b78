"""Point-to-point transfers of one step, posted in the plan's agreed order.

Every rank posts its sends and receives in :attr:`MessagePlan.sequence`, an
order both ends of every pair share and that NCCL's one-stream-per-pair FIFO
cannot deadlock on (see :mod:`.plan`). Within that order a send is posted as
soon as its op produced it (never blocking the op), and receives are posted as
early as the order allows, up to the ones the next few ops need (prefetch), so
their transfers overlap compute. Sends are reaped when complete (freeing sent
activations) and waited for at the end of the step; receives are waited for
just before the op that needs them, and the time spent in those waits is
summed (``waited_ns``) so a tracer can tell waiting from computing.

Before its first step over a process group, a rank exchanges one small message
with each peer, pairs taken in one global order: on NCCL the first message of a
pair creates its communicator, a host rendezvous of the two ranks that must not
happen in the middle of a schedule. Every wait has a timeout, so a failed peer
turns into :class:`PipelineCommError`, not a hang. With strict mode on
(``DUALPIPE_NCCL_STRICT=1``), the step's calls are recorded and checked against
the model of NCCL's semantics at its end (:mod:`.strict`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from time import perf_counter_ns
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from .comm_log import RECV, SEND, CommLog
from .plan import ACT, GRAD, Message, MessagePlan
from .strict import StepRecorder, strict_from_env

_KIND_CODE = {ACT: 0, GRAD: 1}

Shape = tuple[int, ...]

# Pairs (group name, global lo, global hi) whose NCCL communicator this process has created.
_WARM_PAIRS: set[tuple[str, int, int]] = set()


class PipelineCommError(RuntimeError):
    """A p2p wait that timed out or failed; names this rank, the peer, the op and the micro-batch."""


class Transport(Protocol):
    """Where the p2p layer's posts go; peers are pipeline ranks."""

    name: str  # the process group's name: one queue identity for the NCCL model
    warm: set[tuple[str, int, int]]  # pairs already connected (see _WARM_PAIRS)

    def isend(self, tensor: torch.Tensor, peer: int) -> Any: ...

    def irecv(self, tensor: torch.Tensor, peer: int) -> Any: ...

    def wait(self, handle: Any, timeout: float) -> None: ...

    def is_completed(self, handle: Any) -> bool: ...

    def global_rank(self, peer: int) -> int: ...


class DistTransport:
    """``torch.distributed`` p2p over ``group``; ``group_rank_of[r]`` is pipeline rank r's group rank."""

    warm = _WARM_PAIRS

    def __init__(self, group: dist.ProcessGroup, group_rank_of: Sequence[int]) -> None:
        self.group = group
        self.group_rank_of = list(group_rank_of)
        self.name = group.group_name

    def isend(self, tensor: torch.Tensor, peer: int) -> dist.Work:
        return dist.isend(tensor, group=self.group, group_dst=self.group_rank_of[peer])

    def irecv(self, tensor: torch.Tensor, peer: int) -> dist.Work:
        return dist.irecv(tensor, group=self.group, group_src=self.group_rank_of[peer])

    @staticmethod
    def wait(handle: dist.Work, timeout: float) -> None:
        handle.wait(timeout=timedelta(seconds=timeout))

    def is_completed(self, handle: dist.Work) -> bool:
        return handle.is_completed()

    def global_rank(self, peer: int) -> int:
        return dist.get_global_rank(self.group, self.group_rank_of[peer])


class DryTransport:
    """No communication at all: receives read zeros. Runs a rank's real posting logic alone."""

    name = "pipeline"

    def __init__(self) -> None:
        self.warm: set[tuple[str, int, int]] = set()

    def isend(self, tensor: torch.Tensor, peer: int) -> None:
        return None

    def irecv(self, tensor: torch.Tensor, peer: int) -> None:
        tensor.zero_()

    def wait(self, handle: None, timeout: float) -> None:
        return None

    def is_completed(self, handle: None) -> bool:
        return True

    def global_rank(self, peer: int) -> int:
        return peer


@dataclass
class _Posted:
    handle: Any
    ident: int | None  # its id in the step's CommLog (strict mode)


@dataclass
class _Recv:
    works: list[_Posted]
    buffers: list[torch.Tensor]
    header: torch.Tensor | None


@dataclass
class _Send:
    works: list[_Posted]
    msg: Message
    dst: int
    after: str
    payload: list[torch.Tensor]  # held until the send completes (it may be a contiguous copy)
    to_free: list[torch.Tensor]


class P2P:
    """Posts and waits for one step's transfers of one rank, following a :class:`MessagePlan`.

    With ``debug`` every message is preceded by a header carrying its
    (kind, d, s, m), checked on arrival. ``strict`` (default: the
    ``DUALPIPE_NCCL_STRICT`` environment variable) records the step's calls and
    fails the step if the NCCL model finds that they could deadlock; ``record``
    only keeps the step's calls in :attr:`log`.
    """

    def __init__(
        self,
        transport: Transport,
        rank: int,
        device: torch.device,
        shapes: Callable[[tuple[int, int]], list[Shape]],
        dtype: torch.dtype,
        timeout: float,
        debug: bool = False,
        strict: bool | None = None,
        record: bool = False,
    ) -> None:
        self.transport = transport
        self.rank = rank
        self.device = device
        self.shapes = shapes
        self.dtype = dtype
        self.timeout = timeout
        self.debug = debug
        self.strict = strict_from_env() if strict is None else strict
        self.record = record or self.strict
        self._plan: MessagePlan | None = None
        self.log: CommLog | None = None
        self._recorder: StepRecorder | None = None

    # -- step lifecycle ----------------------------------------------------
    def begin(self, plan: MessagePlan) -> None:
        """Start a step: connect new pairs, and in strict mode start recording."""
        self._plan = plan
        self._next = 0  # index of the first unposted item of plan.sequence
        self._recvs: dict[Message, _Recv] = {}
        self._sends: list[_Send] = []
        self.freed = 0
        self.waited_ns = 0  # this step's time blocked in receives (two clock reads per message)
        self.log = None
        if self.record:
            ranks = [self.transport.global_rank(r) for r in range(plan.ranks)]
            self.log = CommLog(self.transport.global_rank(self.rank), ranks, sorted(self.transport.warm))
        if self.strict:
            assert self.log is not None
            self._recorder = StepRecorder(self.log)
            self._recorder.start()
        self._warm_up(plan.peers)

    def finish(self) -> None:
        """Wait for every send; check that every planned message was posted and used."""
        for send in self._sends:
            self._wait_all(send.works, f"sending {send.msg} to rank {send.dst}, sent after {send.after}", send.dst)
            self._free(send.to_free)
        self._sends = []
        assert self._plan is not None
        if self._next != len(self._plan.sequence) or self._recvs:
            unposted = [f"{kind} {msg}" for kind, msg, _ in self._plan.sequence[self._next:]]
            raise RuntimeError(
                f"pipeline rank {self.rank}: step ended with planned messages unused "
                f"(unposted {unposted[:4]}{'...' if len(unposted) > 4 else ''}, "
                f"posted but unread {sorted(map(str, self._recvs))})"
            )
        if self._recorder is not None:
            recorder, self._recorder = self._recorder, None
            recorder.stop()
            recorder.check(self.timeout)

    def abort(self) -> None:
        """The step failed: stop recording (nothing is checked)."""
        if self._recorder is not None:
            self._recorder.stop()
            self._recorder = None

    def _warm_up(self, peers: Sequence[int]) -> None:
        """Connect every new pair with one small exchange, pairs in one global order (see module doc)."""
        me = self.transport.global_rank(self.rank)
        pairs = []
        for peer in peers:
            other = self.transport.global_rank(peer)
            pair = (self.transport.name, min(me, other), max(me, other))
            if pair not in self.transport.warm:
                pairs.append((pair, peer))
        for pair, peer in sorted(pairs):
            what = f"warm-up of the pair with rank {peer}"
            out = torch.zeros(1, dtype=self.dtype, device=self.device)
            back = torch.empty(1, dtype=self.dtype, device=self.device)
            if me == pair[1]:
                works = [self._isend(out, peer, what), self._irecv(back, peer, what)]
            else:
                works = [self._irecv(back, peer, what), self._isend(out, peer, what)]
            self._wait_all(works, what, peer)
            self.transport.warm.add(pair)

    # -- posting (every post goes through these two, so strict mode sees it) ----
    def _isend(self, tensor: torch.Tensor, peer: int, what: str) -> _Posted:
        return self._post(SEND, self.transport.isend, tensor, peer, what)

    def _irecv(self, tensor: torch.Tensor, peer: int, what: str) -> _Posted:
        return self._post(RECV, self.transport.irecv, tensor, peer, what)

    def _post(self, kind: str, post: Callable[[torch.Tensor, int], Any], tensor: torch.Tensor, peer: int,
              what: str) -> _Posted:
        try:
            handle = post(tensor, peer)
        except RuntimeError as exc:  # e.g. gloo: the peer's connection is already closed
            raise PipelineCommError(
                f"pipeline rank {self.rank}: posting the {kind} of {what} (peer rank {peer}) failed: {exc}"
            ) from exc
        ident = None
        if self.log is not None:
            ident = self.log.post(kind, self.transport.name, self.transport.global_rank(peer), what)
        return _Posted(handle, ident)

    def _post_through(self, target: int) -> bool:
        """Post the sequence's receives up to ``target``; False if an unproduced send comes first."""
        assert self._plan is not None
        sequence = self._plan.sequence
        while self._next <= target:
            kind, msg, peer = sequence[self._next]
            if kind == SEND:
                return False
            self._post_recv(msg, peer)
            self._next += 1
        return True

    def _index(self, kind: str, msg: Message, peer: int) -> int:
        assert self._plan is not None
        try:
            return self._plan.index[(kind, msg)]
        except KeyError:
            way = "from" if kind == RECV else "to"
            raise RuntimeError(
                f"pipeline rank {self.rank}: {msg} {way} rank {peer} is not in the message plan"
            ) from None

    # -- receiving -----------------------------------------------------------
    def prefetch(self, needs: Sequence[tuple[Message, int]]) -> None:
        """Post every receive the order allows, up to the ones listed."""
        for msg, src in needs:
            if not self._post_through(self._index(RECV, msg, src)):
                return

    def recv(self, msg: Message, src: int, needed_by: str) -> list[torch.Tensor]:
        """The tensors of ``msg`` from ``src``, once arrived (``needed_by`` names the op for errors)."""
        if not self._post_through(self._index(RECV, msg, src)):
            kind, first, peer = self._plan.sequence[self._next]
            raise RuntimeError(
                f"pipeline rank {self.rank}: {needed_by} needs {msg} from rank {src}, which the plan orders "
                f"after {kind} {first} (rank {peer}) that this rank has not produced yet"
            )
        pending = self._recvs.pop(msg)
        what = f"receiving {msg} from rank {src}, needed by {needed_by}"
        began = perf_counter_ns()
        if pending.header is not None:
            self._wait_all(pending.works[:1], what, src)
            self._check_header(pending.header, msg, src, len(pending.buffers), needed_by)
            self._wait_all(pending.works[1:], what, src)
        else:
            self._wait_all(pending.works, what, src)
        self.waited_ns += perf_counter_ns() - began
        return pending.buffers

    def _post_recv(self, msg: Message, src: int) -> None:
        header = None
        works: list[_Posted] = []
        what = f"{msg} from rank {src}"
        if self.debug:
            header = torch.empty(5, dtype=torch.int64, device=self.device)
            works.append(self._irecv(header, src, f"header of {what}"))
        buffers = [torch.empty(shape, dtype=self.dtype, device=self.device) for shape in self.shapes(msg.edge)]
        works += [self._irecv(t, src, what) for t in buffers]
        self._recvs[msg] = _Recv(works, buffers, header)

    def _check_header(self, header: torch.Tensor, msg: Message, src: int, count: int, needed_by: str) -> None:
        got = [int(v) for v in header.tolist()]
        want = [_KIND_CODE[msg.kind], msg.key.d, msg.key.s, msg.key.m, count]
        if got != want:
            kinds = {v: k for k, v in _KIND_CODE.items()}
            described = (
                f"{kinds.get(got[0], got[0])} of (d={got[1]},s={got[2]},m={got[3]}) with {got[4]} tensor(s)"
            )
            raise PipelineCommError(
                f"pipeline rank {self.rank}: message mismatch from rank {src} for {needed_by}: "
                f"expected {msg} with {count} tensor(s), got {described}"
            )

    # -- sending -------------------------------------------------------------
    def send(
        self, msg: Message, dst: int, tensors: Sequence[torch.Tensor], after: str,
        free: Sequence[torch.Tensor] = (),
    ) -> None:
        """Post ``tensors`` as ``msg``; the tensors in ``free`` lose their storage once sent."""
        shapes = self.shapes(msg.edge)
        if len(tensors) != len(shapes):
            raise ValueError(
                f"pipeline rank {self.rank}: {msg} has {len(tensors)} tensor(s), but "
                f"{len(shapes)} are declared for the outputs of stage (d={msg.edge[0]},s={msg.edge[1]})"
            )
        for i, (t, shape) in enumerate(zip(tensors, shapes)):
            if tuple(t.shape) != tuple(shape) or t.dtype != self.dtype:
                raise ValueError(
                    f"pipeline rank {self.rank}: tensor {i} of {msg} is {tuple(t.shape)} {t.dtype}, "
                    f"but the declared p2p shape is {tuple(shape)} {self.dtype}"
                )
        index = self._index(SEND, msg, dst)
        if index < self._next or not self._post_through(index - 1):
            raise RuntimeError(
                f"pipeline rank {self.rank}: {msg} to rank {dst} sent out of the plan's order"
            )
        payload = [t.contiguous() for t in tensors]
        what = f"{msg} to rank {dst}"
        works: list[_Posted] = []
        if self.debug:
            k = msg.key
            header = torch.tensor(
                [_KIND_CODE[msg.kind], k.d, k.s, k.m, len(payload)], dtype=torch.int64, device=self.device
            )
            works.append(self._isend(header, dst, f"header of {what}"))
            payload = [header] + payload  # held with the rest until the send completes
        works += [self._isend(t, dst, what) for t in payload[len(works):]]
        self._next = index + 1
        # Free only tensors that went out as they are (a contiguous copy was sent otherwise).
        to_free = [t for t in free if any(t is p for p in payload)]
        self._sends.append(_Send(works, msg, dst, after, payload, to_free))

    def reap(self) -> None:
        """Without blocking, retire completed sends and free what they carried."""
        still = []
        for send in self._sends:
            if all(self.transport.is_completed(w.handle) for w in send.works):
                self._free(send.to_free)
            else:
                still.append(send)
        self._sends = still

    def _free(self, tensors: Sequence[torch.Tensor]) -> None:
        """Drop the storage of sent activations; their grad_fn keeps the graph alive for backward."""
        for t in tensors:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self.freed += len(tensors)

    # -- waiting -------------------------------------------------------------
    def _wait_all(self, works: Sequence[_Posted], what: str, peer: int) -> None:
        if self.log is not None:
            self.log.wait([w.ident for w in works], what)
        for work in works:
            wait(work.handle, self.timeout, lambda: f"pipeline rank {self.rank}: {what} (peer rank {peer})",
                 self.transport.wait)


def wait(
    work: Any, timeout: float, describe: Callable[[], str],
    waiter: Callable[[Any, float], None] = DistTransport.wait,
) -> None:
    """Wait for ``work`` at most ``timeout`` seconds; failures become :class:`PipelineCommError`."""
    try:
        waiter(work, timeout)
    except RuntimeError as exc:
        reason = "timed out" if "imed out" in str(exc) else "failed"
        raise PipelineCommError(f"{describe()}: {reason} (timeout {timeout:g}s): {exc}") from exc


__all__ = ["DistTransport", "DryTransport", "P2P", "PipelineCommError", "Transport", "wait"]
