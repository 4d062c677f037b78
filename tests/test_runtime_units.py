"""Single-process parts of the runtime: deferred weight grads, freed outputs, the message plan."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as TF
from torch import nn

from dualpipe_megatron.runtime import (
    DeferrableLinear, MessagePlan, WeightGradStore, deferring, make_linears_deferrable, run_backward,
)
from dualpipe_megatron.schedules import build_schedule

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _clean_store():
    WeightGradStore.clear()
    yield
    WeightGradStore.clear()


def _model(bias: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13, bias=bias), nn.Tanh(), nn.Linear(13, 6, bias=bias), nn.LayerNorm(6))


@pytest.mark.parametrize("shape", [(5, 7), (3, 5, 7)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("defer", [True, False])
def test_deferrable_linear_is_bitwise_nn_linear(shape: tuple[int, ...], bias: bool, defer: bool) -> None:
    ref = _model(bias)
    mod = copy.deepcopy(ref)
    assert make_linears_deferrable(mod) == 2
    x = torch.randn(*shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    for step in range(2):  # two micro-batches: the second accumulates onto the first
        ref(x).square().sum().backward()
        with deferring(step, enabled=defer):
            mod(x2).square().sum().backward()
    if defer:
        linear_grads = [p.grad for m in mod if isinstance(m, nn.Linear) for p in m.parameters()]
        assert all(g is None for g in linear_grads), "weight grads were not deferred"
        assert WeightGradStore.pop(0) == 2 and WeightGradStore.pop(1) == 2
    assert torch.equal(x.grad, x2.grad)
    for (name, p), q in zip(ref.named_parameters(), mod.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_only_plain_linears_are_swapped() -> None:
    class Custom(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(2, 2), Custom(2, 2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert make_linears_deferrable(model) == 1
    assert type(model[0]) is DeferrableLinear and type(model[1]) is Custom
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_store_runs_weight_grads_by_key_or_fifo() -> None:
    ran: list[str] = []
    for key in ("a", "b"):
        WeightGradStore.put(lambda key=key: ran.append(key))
        WeightGradStore.flush(key)
    WeightGradStore.pop("b")
    WeightGradStore.put(lambda: ran.append("fifo"))
    WeightGradStore.flush()
    WeightGradStore.pop()  # the oldest left: "a"
    WeightGradStore.pop()
    assert ran == ["b", "a", "fifo"]
    with pytest.raises(KeyError, match="no deferred weight grads"):
        WeightGradStore.pop("a")
    WeightGradStore.flush("c")
    with pytest.raises(KeyError, match="already pending"):
        WeightGradStore.flush("c")


def test_reference_style_autograd_function_defers() -> None:
    """A user Function written for DeepSeek's store (puts its closure when enabled)."""

    class LinearFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input, weight):
            ctx.save_for_backward(input, weight)
            return TF.linear(input, weight)

        @staticmethod
        def backward(ctx, grad_output):
            input, weight = ctx.saved_tensors
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)

            def grad_weight_fn():
                weight.grad += grad_output.T @ input

            if WeightGradStore.enabled:
                WeightGradStore.put(grad_weight_fn)
            else:
                grad_weight_fn()
            return grad_output @ weight, None

    w = nn.Parameter(torch.randn(3, 4))
    x = torch.randn(5, 4)
    with deferring("k"):
        LinearFunc.apply(x, w).sum().backward()
    assert torch.count_nonzero(w.grad) == 0
    WeightGradStore.pop("k")
    assert torch.allclose(w.grad, torch.ones(5, 3).T @ x)


def test_backward_through_freed_outputs() -> None:
    """Sent activations lose their storage; backward needs only their grad_fn."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(3, 4, requires_grad=True)
    grad = torch.randn(3, 4)
    layer(x).backward(grad)
    want = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    y = layer(x)
    y.data = torch.empty(0)
    run_backward([y], [grad])
    got = [x.grad] + [p.grad for p in layer.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _replay_protocol(name: str, ranks: int, microbatches: int, forward_only: bool) -> None:
    """Run every rank's plan against per-pair FIFO channels, as gloo/NCCL match p2p.

    The k-th receive a rank posts from a peer gets the k-th message that peer
    sent it; every match must be the message the receiver planned, and every
    rank must finish (no deadlock).
    """
    sched = build_schedule(name, ranks, microbatches)
    plans = [MessagePlan.build(sched, r, forward_only) for r in range(ranks)]
    sent: dict[tuple[int, int], list] = {}
    cursor = [(0, 0)] * ranks  # (op, half)
    progressed = True
    while progressed:
        progressed = False
        for r, plan in enumerate(plans):
            while cursor[r][0] < len(plan.ops):
                n, h = cursor[r]
                needs = plan.recvs[n][h]
                if any(
                    len(sent.get((src, r), [])) <= plan.incoming[src].index(msg) for msg, src in needs
                ):
                    break
                for msg, dst in plan.sends[n][h]:
                    channel = sent.setdefault((r, dst), [])
                    assert plans[dst].incoming[r][len(channel)] == msg, f"{name}: rank {dst} would mismatch"
                    channel.append(msg)
                h += 1
                cursor[r] = (n + 1, 0) if h == len(plan.ops[n][1]) else (n, h)
                progressed = True
    assert all(c[0] == len(p.ops) for c, p in zip(cursor, plans)), f"{name}: deadlock at {cursor}"
    for (src, dst), msgs in sent.items():
        assert msgs == plans[dst].incoming[src]


@pytest.mark.parametrize("name", ["dualpipev", "dualpipe", "1f1b", "zb1p", "interleaved"])
@pytest.mark.parametrize("ranks", [2, 4, 6])
@pytest.mark.parametrize("forward_only", [False, True])
def test_message_plan_matches_in_posting_order(name: str, ranks: int, forward_only: bool) -> None:
    for microbatches in (2 * ranks, 3 * ranks, 4 * ranks):
        _replay_protocol(name, ranks, microbatches, forward_only)
