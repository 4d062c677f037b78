"""The loss-report relay's layout and flat tensors (dualpipe_megatron/megatron/relay.py), no processes.

The relay itself runs in every multi-rank Megatron test (the last pipeline rank's logged losses
equal 1F1B's); here: what is sent once, what every step, and that the receiver's reports are
the sender's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from dualpipe_megatron.megatron.relay import _flat, _unflat, layout_of

pytestmark = pytest.mark.unit


def _reports() -> list[dict]:
    torch.manual_seed(0)
    return [{"lm loss": torch.randn(2), "mtp": torch.randn(1, 3, dtype=torch.float64),
             "tokens": torch.tensor([7, 9])} for _ in range(3)]


def test_dicts_of_tensors_go_as_one_flat_tensor_per_dtype() -> None:
    reports = _reports()
    layout = layout_of(reports)
    assert layout is not None and layout[0] == (("lm loss", torch.float32, (2,)), ("mtp", torch.float64, (1, 3)),
                                                ("tokens", torch.int64, (2,)))
    flats = _flat(reports, layout)
    assert [(f.dtype, f.numel()) for f in flats] == [(torch.float32, 6), (torch.float64, 9), (torch.int64, 6)]
    back = _unflat([f.clone() for f in flats], layout)
    assert len(back) == 3
    for got, want in zip(back, reports):
        assert list(got) == list(want)
        assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def test_other_reports_have_no_layout() -> None:
    assert layout_of([{"lm loss": 1.5}]) is None
    assert layout_of([(torch.ones(1),)]) is None
    assert layout_of([]) == ()
