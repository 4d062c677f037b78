"""Runs one rank's op list: forward, backward, deferred weight grads and F&B pairs.

The executor has no schedule logic and computes nothing itself. It walks the
:class:`MessagePlan` (the rank's ops, what each op receives first and sends
after), calls its :class:`~.handlers.StageHandlers` with each op, and keeps
per-(d,s,m) state between the F and the B/W that the IR pairs by key. An
optional :class:`OpObserver` hears about each executed op with its host-clock
times; without one the loop reads no clock (the p2p layer still sums receive
waits, two clock reads per message).
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any, Protocol, Sequence

import torch

from ..schedules.ir import B, F, Key, Schedule, W
from ..schedules.lower import describe
from .handlers import StageHandlers
from .p2p import P2P
from .plan import ACT, GRAD, Message, MessagePlan
from .profiler_ranges import op_range
from .wgrad import DeferredWeightGrads, deferring

Half = F | B | W


@dataclass
class StepStats:
    """Counters of one step on one rank.

    ``live``/``peak``: (d,s,m) whose activations this rank holds, from the start
    of its F until its weight grad is done (the simulator's definition).
    ``freed``: sent activations whose storage was released. ``deferred``:
    weight-grad closures run by W ops. ``overlapped``: FB ops run through the
    handlers' :meth:`~.handlers.StageHandlers.pair` (the others ran F then B).
    """

    live: int = 0
    peak: int = 0
    freed: int = 0
    deferred: int = 0
    overlapped: int = 0


class OpObserver(Protocol):
    """Told about every op one rank executes (e.g. :class:`dualpipe_megatron.trace.OpTracer`).

    Times are ``time.perf_counter_ns()`` readings taken by the executor: ``begin``
    before the op's first receive, ``end`` after its sends are posted; ``wait_ns``
    of that span was spent blocked in receives.
    """

    def step_begun(self, sched: Schedule, forward_only: bool) -> None: ...

    def op_done(self, index: int, parts: tuple[Half, ...], begin_ns: int, end_ns: int, wait_ns: int) -> None: ...

    def step_done(self) -> None: ...


class Executor:
    """Executes the plan of one rank, computing through ``handlers``.

    Receives the next ``recv_lookahead`` ops need are posted before each op, as
    far as the plan's message order allows, so their transfers overlap compute;
    each costs one p2p buffer held early. FB ops that ``handlers.pairs`` accepts
    run as one ``handlers.pair`` call unless ``use_overlap_hook`` is false. The
    executor owns its weight-grad store (``wgrad_store``).
    """

    def __init__(
        self,
        sched: Schedule,
        rank: int,
        handlers: StageHandlers,
        p2p: P2P,
        defer_weight_grads: bool = True,
        use_overlap_hook: bool = True,
        recv_lookahead: int = 2,
        observer: OpObserver | None = None,
    ) -> None:
        self.sched = sched
        self.rank = rank
        self.handlers = handlers
        self.p2p = p2p
        self.defer = defer_weight_grads
        self.use_overlap_hook = use_overlap_hook
        self.recv_lookahead = recv_lookahead
        self.observer = observer
        self.stats = StepStats()
        self.wgrad_store = DeferredWeightGrads()

    # -- the loop --------------------------------------------------------------
    def run(self, plan: MessagePlan, forward_only: bool) -> None:
        self._start(forward_only)
        observer = self.observer
        if observer is not None:
            observer.step_begun(self.sched, forward_only)
        try:
            self.p2p.begin(plan)
            for n, (index, parts) in enumerate(plan.ops):
                ahead = plan.recvs[n:n + 1 + self.recv_lookahead]
                self.p2p.prefetch([item for per_op in ahead for needs in per_op for item in needs])
                if observer is None:
                    self._run_op(plan, n, index, parts)
                else:
                    waited, begin = self.p2p.waited_ns, perf_counter_ns()
                    self._run_op(plan, n, index, parts)
                    observer.op_done(index, parts, begin, perf_counter_ns(), self.p2p.waited_ns - waited)
                self.p2p.reap()
            self.p2p.finish()
        except BaseException:
            self.p2p.abort()
            raise
        if observer is not None:
            observer.step_done()
        self.stats.freed = self.p2p.freed
        self._check_drained()

    def _run_op(self, plan: MessagePlan, n: int, index: int, parts: tuple[Half, ...]) -> None:
        where = describe(index, parts)
        with op_range(parts), self.wgrad_store.activated():
            if len(parts) == 2 and self._paired(parts[0], parts[1]):
                self._pair(parts[0], parts[1], plan.recvs[n], plan.sends[n], where)
            else:
                for half, needs, sends in zip(parts, plan.recvs[n], plan.sends[n]):
                    self._receive(needs, where)
                    self._send(sends, *self._run_half(half), where)

    def _start(self, forward_only: bool) -> None:
        self.wgrad_store.clear()
        self.training = not forward_only
        self.stats = StepStats()
        self._live: set[Key] = set()
        self._arrived: dict[Message, list[torch.Tensor]] = {}
        self._inputs: dict[Key, list[Any]] = {}
        self._outputs: dict[Key, list[torch.Tensor]] = {}
        self._handoff: dict[Key, list[torch.Tensor]] = {}
        self._local_grads: dict[Key, list[torch.Tensor | None]] = {}
        self._loss_graph: dict[Key, torch.Tensor] = {}

    def _check_drained(self) -> None:
        leftovers = {
            "received": self._arrived, "inputs": self._inputs, "outputs": self._outputs,
            "hand-offs": self._handoff, "local grads": self._local_grads, "losses": self._loss_graph,
            "live": self._live, "deferred weight grads": self.wgrad_store.pending(),
        }
        left = {name: sorted(map(str, items)) for name, items in leftovers.items() if items}
        if left:
            raise RuntimeError(f"pipeline rank {self.rank}: step ended with state left over: {left}")

    # -- helpers -----------------------------------------------------------------
    def _paired(self, f: Half, b: Half) -> bool:
        return self.use_overlap_hook and isinstance(f, F) and isinstance(b, B) and self.handlers.pairs(f, b)

    def _is_last(self, key: Key) -> bool:
        return key.s == self.sched.stages - 1

    def _next_is_local(self, key: Key) -> bool:
        return self.sched.rank_of(key.d, key.s + 1) == self.rank

    def _prev_is_local(self, key: Key) -> bool:
        return self.sched.rank_of(key.d, key.s - 1) == self.rank

    def _receive(self, needs: Sequence[tuple[Message, int]], where: str) -> None:
        for msg, src in needs:
            self._arrived[msg] = self.p2p.recv(msg, src, where)

    def _send(
        self, sends: Sequence[tuple[Message, int]], payload: list[torch.Tensor] | None,
        free: list[torch.Tensor], where: str,
    ) -> None:
        for msg, dst in sends:
            self.p2p.send(msg, dst, payload, after=where, free=free)

    def _run_half(self, half: Half) -> tuple[list[torch.Tensor] | None, list[torch.Tensor]]:
        """Run one F/B/W; return what it sends (if anything) and which of that to free once sent."""
        if isinstance(half, F):
            inputs = self._forward_begin(half.key)
            return self._forward_end(half.key, inputs, *self.handlers.forward(half.key, inputs))
        if isinstance(half, B):
            inputs, loss, outputs, grads = self._backward_begin(half.key)
            with deferring(half.key, enabled=self.defer and not half.w):
                self.handlers.backward(half, inputs, loss, outputs, grads)
            return self._backward_end(half)
        if self.defer:
            self.stats.deferred += self.handlers.weight(half, self.wgrad_store)
        self._live.discard(half.key)
        self.stats.live = len(self._live)
        return None, []

    def _pair(
        self, f: F, b: B, recvs: list[list[tuple[Message, int]]],
        sends: list[list[tuple[Message, int]]], where: str,
    ) -> None:
        """An F&B pair as one ``handlers.pair`` call."""
        for needs in recvs:
            self._receive(needs, where)
        self.stats.overlapped += 1
        inputs0 = self._forward_begin(f.key)
        inputs1, loss1, outputs1, grads1 = self._backward_begin(b.key)
        with deferring(b.key, enabled=self.defer and not b.w):
            outputs0, loss0 = self.handlers.pair(f, inputs0, b, inputs1, loss1, outputs1, grads1)
        self._send(sends[0], *self._forward_end(f.key, inputs0, outputs0, loss0), where)
        self._send(sends[1], *self._backward_end(b), where)

    # -- forward -------------------------------------------------------------------
    def _forward_begin(self, key: Key) -> list[Any]:
        if key.s == 0:
            inputs = self.handlers.first_inputs(key)
        else:
            prev = Key(key.d, key.s - 1, key.m)
            if self._prev_is_local(key):
                inputs = [t.detach() for t in self._handoff.pop(prev)]
            else:
                inputs = self._arrived.pop(Message(ACT, prev))
            if self.training:
                inputs = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
        self._live.add(key)
        self.stats.live = len(self._live)
        self.stats.peak = max(self.stats.peak, self.stats.live)
        return inputs

    def _forward_end(
        self, key: Key, inputs: list[Any], outputs: list[torch.Tensor], loss: torch.Tensor | None,
    ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor]]:
        if self.training:
            self._inputs[key] = inputs
        else:
            self._live.discard(key)
            self.stats.live = len(self._live)
        if self._is_last(key):
            if loss is not None and self.training:
                self._loss_graph[key] = loss
            return None, []
        if self.training:
            self._outputs[key] = outputs
        if self._next_is_local(key):
            self._handoff[key] = outputs
            return None, []
        # A sent activation is needed again only through its grad_fn, so its
        # storage can go once the send is done (unless it is a view or an input).
        free = [o for o in outputs if o._base is None and not any(o is i for i in inputs)]
        return outputs, free

    # -- backward -------------------------------------------------------------------
    def _backward_begin(
        self, key: Key,
    ) -> tuple[list[Any], torch.Tensor | None, list[torch.Tensor], list[torch.Tensor]]:
        inputs = self._inputs[key]
        if self._is_last(key):
            return inputs, self._loss_graph.pop(key), [], []
        outputs = self._outputs.pop(key)
        nxt = Key(key.d, key.s + 1, key.m)
        if self._next_is_local(key):
            grads = self._local_grads.pop(nxt)
        else:
            grads = self._arrived.pop(Message(GRAD, nxt))
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        return inputs, None, [o for o, _ in pairs], [g for _, g in pairs]

    def _backward_end(self, half: B) -> tuple[list[torch.Tensor] | None, list[torch.Tensor]]:
        key = half.key
        inputs = self._inputs.pop(key)
        if half.w or not self.defer:
            self._live.discard(key)
            self.stats.live = len(self._live)
        if key.s == 0:
            return None, []
        grads = [t.grad for t in inputs]
        if self._prev_is_local(key):
            self._local_grads[key] = grads
            return None, []
        # An input that got no grad still owes its peer a tensor of the declared shape.
        return [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, inputs)], []


__all__ = ["Executor", "OpObserver", "StepStats"]
