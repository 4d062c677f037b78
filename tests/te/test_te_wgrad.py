"""Deferral of Megatron's delayed wgrad to a schedule's W, on real Transformer Engine linears.

tests/test_wgrad_te.py runs the same node checks with a stand-in for TE (everywhere, TE or not);
here the node's callables are TE's own ``Linear`` with ``delay_wgrad_compute=True``, each holding a
queued weight GEMM in its ``wgrad_store`` as TE's backward leaves it, and TE's own ``backward_dw``
pops it. The GEMM is a closure returning a marker gradient (TE's real one needs a GPU).
"""

from __future__ import annotations

import pytest
import torch

from dualpipe_megatron.megatron.cpu_compat import install_cpu_compat
from dualpipe_megatron.megatron.wgrad_te import install_delayed_wgrad_deferral
from dualpipe_megatron.runtime.wgrad import WeightGradStore, deferring
from te_helpers import cuda_reported_available
from test_wgrad_te import _node

SIZE = 4


@pytest.fixture(scope="module", autouse=True)
def patched() -> None:
    install_cpu_compat()
    install_delayed_wgrad_deferral()


def _linear(delay: bool = True) -> torch.nn.Module:
    import transformer_engine.pytorch as te

    with cuda_reported_available():
        return te.Linear(SIZE, SIZE, bias=False, params_dtype=torch.float32, device="cpu",
                         delay_wgrad_compute=delay)


def _queue_gemm(linear: torch.nn.Module, calls: list[str], name: str, value: float) -> None:
    """What TE's backward leaves for ``backward_dw``: a closure computing (wgrad, bgrad)."""
    def gemm() -> tuple[torch.Tensor, None]:
        calls.append(name)
        return torch.full((SIZE, SIZE), value), None

    linear.wgrad_store.put([], gemm)


def _node_of_te_linears(calls: list[str], delay: bool = True):
    """Megatron's ``TransformerLayerNode`` (as tests/test_wgrad_te.py builds it) over two TE linears
    with one queued GEMM each."""
    node = _node(calls, delay)
    node.bwd_dw_callables = [_linear(delay), _linear(delay)]
    if delay:
        for i, (name, linear) in enumerate(zip(("fc2", "fc1"), node.bwd_dw_callables)):
            _queue_gemm(linear, calls, name, float(i + 1))
    return node


def _grads(linears: list[torch.nn.Module]) -> list[float | None]:
    return [None if m.weight.grad is None else m.weight.grad[0, 0].item() for m in linears]


def test_tes_queue_pops_the_oldest_gemm_first() -> None:
    """What fifo_order_violations assumes: a module's later backward_dw runs its oldest pending GEMM."""
    linear, calls = _linear(), []
    _queue_gemm(linear, calls, "micro-batch 0", 1.0)
    _queue_gemm(linear, calls, "micro-batch 1", 2.0)
    linear.backward_dw()
    assert calls == ["micro-batch 0"] and _grads([linear]) == [1.0]
    linear.backward_dw()
    assert calls == ["micro-batch 0", "micro-batch 1"] and _grads([linear]) == [2.0]
    with pytest.raises(RuntimeError, match="Pop empty queue"):  # a W with nothing queued fails loudly
        linear.backward_dw()


def test_backward_dw_runs_tes_gemms_at_once_outside_a_deferred_backward() -> None:
    calls: list[str] = []
    node = _node_of_te_linears(calls)
    linears = list(node.bwd_dw_callables)
    node.backward_dw()
    assert calls == ["fc2", "fc1", "post_backward_hook"]
    assert _grads(linears) == [1.0, 2.0]


def test_backward_dw_moves_tes_gemms_to_the_w_of_a_deferred_backward() -> None:
    WeightGradStore.clear()
    calls: list[str] = []
    node = _node_of_te_linears(calls)
    linears = list(node.bwd_dw_callables)
    key = (0, 1, 2)
    with deferring(key):
        node.backward_dw()
    assert calls == [] and WeightGradStore.pending() == [key]
    assert [m.wgrad_store.context.qsize() for m in linears] == [1, 1] and _grads(linears) == [None, None]
    assert WeightGradStore.pop(key) == 1
    assert calls == ["fc2", "fc1", "post_backward_hook"]
    assert _grads(linears) == [1.0, 2.0] and [m.wgrad_store.context.qsize() for m in linears] == [0, 0]


def test_without_delayed_wgrad_nothing_is_filed() -> None:
    """TE linears built without delay compute their weight grads in backward: Megatron's node
    skips them, and nothing may be filed for W."""
    WeightGradStore.clear()
    calls: list[str] = []
    node = _node_of_te_linears(calls, delay=False)
    assert not any(m.need_backward_dw() for m in node.bwd_dw_callables)
    with deferring((0, 0, 0)):
        node.backward_dw()
    assert calls == [] and WeightGradStore.pop((0, 0, 0)) == 0
