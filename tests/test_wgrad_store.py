"""Each executor owns its weight-grad store: two in one process keep their deferred grads apart,
and a backward on another thread (as CUDA's autograd runs it) still files into the right one.

Executors run in-process as in ``runtime.dry_run``: rank 0 of a 2-rank DualPipeV over a
``DryTransport`` (receives read zeros), so a step needs no other process.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from dualpipe_megatron.compat.utils import WeightGradStore
from dualpipe_megatron.runtime import handlers as handlers_module
from dualpipe_megatron.runtime.executor import Executor
from dualpipe_megatron.runtime.handlers import ModuleHandlers, StepData
from dualpipe_megatron.runtime.p2p import DryTransport, P2P
from dualpipe_megatron.runtime.plan import MessagePlan
from dualpipe_megatron.runtime.wgrad import make_linears_deferrable, run_backward
from dualpipe_megatron.schedules import build_schedule

pytestmark = pytest.mark.unit

WIDTH, RANK = 4, 0
SCHED = build_schedule("dualpipev", 2, 4)
PLAN = MessagePlan.build(SCHED, RANK, forward_only=False)


class _Run:
    """One executor with its own stages and inputs (``seed`` makes both differ between runs)."""

    def __init__(self, seed: int, observer: Any = None) -> None:
        torch.manual_seed(seed)
        self.chunks = {
            ds: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
            for ds in SCHED.stages_on(RANK)
        }
        for chunk in self.chunks.values():
            make_linears_deferrable(chunk)
        p2p = P2P(DryTransport(), RANK, torch.device("cpu"), lambda edge: [(1, WIDTH)], torch.float32,
                  timeout=1.0, strict=False)
        count = SCHED.microbatches_per_direction
        inputs = {0: [(torch.randn(1, WIDTH),) for _ in range(count)]}
        data = StepData(inputs, {0: [()] * count}, lambda out: out.square().sum(), False)
        self.executor = Executor(SCHED, RANK, ModuleHandlers(self.chunks, data, SCHED.stages - 1), p2p,
                                 observer=observer)

    def step(self) -> list[torch.Tensor]:
        self.executor.run(PLAN, forward_only=False)
        return [p.grad for chunk in self.chunks.values() for p in chunk.parameters()]


class _StepOtherWhilePending:
    """Observer of one executor: once that executor holds deferred weight grads, run a whole
    step of ``other`` (which clears, fills and drains its own store) before going on."""

    def __init__(self) -> None:
        self.owner: Executor | None = None
        self.other: _Run | None = None
        self.pending_at_switch: list = []

    def step_begun(self, sched: Any, forward_only: bool) -> None: ...

    def op_done(self, index: int, parts: tuple, begin_ns: int, end_ns: int, wait_ns: int) -> None:
        assert self.owner is not None and self.other is not None
        if not self.pending_at_switch and self.owner.wgrad_store.pending():
            self.pending_at_switch = self.owner.wgrad_store.pending()
            self.other.step()

    def step_done(self) -> None: ...


def _equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def test_interleaved_executors_keep_their_own_deferred_grads() -> None:
    alone_a, alone_b = _Run(seed=1).step(), _Run(seed=2).step()

    switch = _StepOtherWhilePending()
    a, b = _Run(seed=1, observer=switch), _Run(seed=2)
    switch.owner, switch.other = a.executor, b
    got_a = a.step()  # B's whole step runs inside, while A's W closures wait
    assert switch.pending_at_switch, "executor A never held deferred weight grads"
    got_b = [p.grad for chunk in b.chunks.values() for p in chunk.parameters()]
    assert _equal(got_a, alone_a) and _equal(got_b, alone_b)
    assert a.executor.stats.deferred > 0 and b.executor.stats.deferred > 0
    assert WeightGradStore.pending() == [], "the process-wide store got an executor's grads"


def test_backward_on_another_thread_defers_into_the_executor_store(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _Run(seed=3)
    want = plain.step()

    def backward_on_a_thread(tensors, grads) -> None:
        """As on CUDA: the engine runs backward on its own thread while the caller waits."""
        failed: list[BaseException] = []

        def work() -> None:
            try:
                run_backward(tensors, grads)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                failed.append(exc)

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        if failed:
            raise failed[0]

    monkeypatch.setattr(handlers_module, "run_backward", backward_on_a_thread)
    threaded = _Run(seed=3)
    assert _equal(threaded.step(), want)
    assert threaded.executor.stats.deferred == plain.executor.stats.deferred > 0
