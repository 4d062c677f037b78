"""Deferral of Megatron's delayed wgrad (``TransformerLayerNode.backward_dw``) to a schedule's W.

The TE modules are stood in for by a module whose ``backward_dw`` records its calls, so that these
checks run in every ``make test``, Transformer Engine installed or not; the node is Megatron's own
``TransformerLayerNode`` with its own ``backward_dw`` running underneath our patch. The TE tier
(tests/te/test_te_wgrad.py, in ``.venv-te``) runs the node checks on real TE linears and TE's own
queue, and tests/te/test_te_chunks.py every TE linear of the DeepSeek-V3 proxy's chunks.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from dualpipe_megatron.megatron.cpu_compat import install_cpu_compat
from dualpipe_megatron.megatron.refusals import delayed_wgrad_problems
from dualpipe_megatron.megatron.wgrad_te import (
    fifo_order_violations, install_delayed_wgrad_deferral,
)
from dualpipe_megatron.runtime.wgrad import WeightGradStore, deferring
from dualpipe_megatron.schedules import Schedule, W, build_schedule

pytestmark = pytest.mark.unit


class _RecordingModule(torch.nn.Module):
    """Stands in for a TE linear: ``backward_dw`` pops one queued weight GEMM."""

    def __init__(self, calls: list[str], name: str) -> None:
        super().__init__()
        self.calls, self.label = calls, name

    def backward_dw(self) -> None:
        self.calls.append(self.label)


def _node(calls: list[str], delay: bool):
    from megatron.core.models.common.utils import TransformerLayerNode

    node = TransformerLayerNode.__new__(TransformerLayerNode)
    node.delay_wgrad_compute = delay
    node.stream = None  # torch.cuda.stream(None) is a no-op context
    node.name = "mlp"
    node.bwd_dw_callables = [_RecordingModule(calls, "fc2"), _RecordingModule(calls, "fc1")]
    node.post_wgrad_grad_acc_hooks = None
    node.is_layer_first_node = True
    node._post_backward_hook = lambda: calls.append("post_backward_hook")
    return node


@pytest.fixture(scope="module", autouse=True)
def patched() -> None:
    install_cpu_compat()
    install_delayed_wgrad_deferral()


def test_backward_dw_runs_at_once_outside_a_deferred_backward() -> None:
    calls: list[str] = []
    _node(calls, delay=True).backward_dw()
    assert calls == ["fc2", "fc1", "post_backward_hook"]


def test_backward_dw_moves_to_the_w_of_a_deferred_backward() -> None:
    WeightGradStore.clear()
    calls: list[str] = []
    key = (0, 1, 2)
    with deferring(key):
        _node(calls, delay=True).backward_dw()
    assert calls == [] and WeightGradStore.pending() == [key]
    assert WeightGradStore.pop(key) == 1
    assert calls == ["fc2", "fc1", "post_backward_hook"]


def test_without_delayed_wgrad_the_node_is_left_alone() -> None:
    """Megatron's backward_dw is a no-op then; nothing may be filed for W."""
    WeightGradStore.clear()
    calls: list[str] = []
    with deferring((0, 0, 0)):
        _node(calls, delay=False).backward_dw()
    assert calls == [] and WeightGradStore.pop((0, 0, 0)) == 0


@pytest.mark.parametrize("name,ranks,m", [("dualpipev", 2, 4), ("dualpipev", 4, 12), ("dualpipev", 8, 20),
                                          ("dualpipe", 4, 8), ("dualpipe", 8, 24), ("zb1p", 4, 8)])
def test_our_schedules_complete_weight_grads_in_backward_order(name: str, ranks: int, m: int) -> None:
    sched = build_schedule(name, ranks, m)
    assert [p for r in range(ranks) for p in fifo_order_violations(sched, r)] == []


def _two_ws_of_one_chunk(sched: Schedule) -> tuple[int, int, int]:
    """(rank, i, j): the first rank with two W ops of the same chunk, at op indices i < j."""
    for rank, ops in enumerate(sched.ops):
        first_w: dict[tuple[int, int], int] = {}
        for j, op in enumerate(ops):
            if isinstance(op, W):
                stage = (op.key.d, op.key.s)
                if stage in first_w:
                    return rank, first_w[stage], j
                first_w[stage] = j
    raise AssertionError("no rank has two W ops of one chunk")


def test_a_w_out_of_backward_order_is_reported() -> None:
    sched = build_schedule("dualpipev", 4, 8)
    rank, first, second = _two_ws_of_one_chunk(sched)
    ops = [list(r) for r in sched.ops]
    ops[rank][first], ops[rank][second] = ops[rank][second], ops[rank][first]
    swapped = dataclasses.replace(sched, ops=ops)
    problems = fifo_order_violations(swapped, rank)
    assert problems and f"op {first} completes the weight grad of {ops[rank][first].key}" in problems[0]


def test_delayed_wgrad_needs_every_backward_through_a_plan() -> None:
    sched = build_schedule("dualpipev", 2, 4)
    on, off = SimpleNamespace(delay_wgrad_compute=True), SimpleNamespace(delay_wgrad_compute=False)
    assert delayed_wgrad_problems(off, sched, 0, overlap=False, deferring=True, forward_only=False) == []
    assert delayed_wgrad_problems(on, sched, 0, overlap=True, deferring=True, forward_only=False) == []
    assert delayed_wgrad_problems(on, sched, 0, overlap=False, deferring=True, forward_only=True) == []
    problems = delayed_wgrad_problems(on, sched, 0, overlap=False, deferring=False, forward_only=False)
    assert len(problems) == 1 and "needs the MoE F&B overlap" in problems[0]
