"""The launch plan's activation estimate against the activation meter on a real job (issue 45).

One pretraining job on 2 CPU processes (the dense GPT of ``bench/activation_estimate.py``, bf16,
DualPipeV at P=2) with Megatron's output-discarding selective recompute of ``layernorm``,
every step under the activation meter (``bench/metered_pretrain.py``): each rank's measured
peak is within 10% of the plan's estimate for the same arguments (``make bench`` runs the whole
grid; on 2026-12-06 this case was within 2%). The terms' own rules are checked without a job.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pretrain_runs import REPO, run

sys.path.insert(0, str(REPO / "bench"))

import activation_estimate as bench  # noqa: E402

from dualpipe_megatron.projection import activations  # noqa: E402
from dualpipe_megatron.schedules.model_shape import ModelShape  # noqa: E402

pytestmark = pytest.mark.multiprocess

TOLERANCE = 0.10
SHAPE = ModelShape(num_layers=8, hidden=64, seq=64, vocab=256, ffn=160, heads=4, gated=True, micro_batch=2)


def test_recompute_drops_exactly_the_named_modules_terms() -> None:
    """Selective recompute drops the terms of the modules named, and nothing else; full
    recompute keeps each group's input and rebuilds one group at a time."""
    plain = activations.Options(impl="local")
    terms = activations.attention(SHAPE, plain) + activations.mlp(SHAPE, plain, moe=False)
    for module in ("core_attn", "layernorm", "mlp"):
        options = activations.Options(impl="local", modules=frozenset({module}))
        dropped = sum(t.per_token for t in terms if t.module == module)
        assert dropped > 0
        assert activations.kept(terms, options) == pytest.approx(activations.kept(terms, plain) - dropped)
    uniform = activations.Options(impl="local", full=("uniform", 2))
    chunk = activations.decoder_bytes(SHAPE, uniform, [False] * 4)
    assert chunk.kept == 2 * activations.layer_input_bytes(SHAPE, uniform)
    assert chunk.rebuilt == 2 * activations.layer_bytes(SHAPE, uniform, False)


def test_unknown_recompute_module_or_implementation_is_refused() -> None:
    with pytest.raises(ValueError, match="--recompute-modules"):
        activations.Options(modules=frozenset({"attention"}))
    with pytest.raises(ValueError, match="transformer implementation"):
        activations.Options(impl="apex")


def test_selective_recompute_estimate_within_ten_percent_of_the_meter(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    case = bench.Case("dense", "dualpipev", "layernorm")
    monkeypatch.setenv("DUALPIPE_METER_DIR", str(tmp_path / "meter"))
    run("metered", tmp_path, case.processes, case.arguments(), script=bench.ENTRY)
    measured = {}
    for path in (tmp_path / "meter").glob("rank*.json"):
        record = json.loads(path.read_text())
        measured[record["pp_rank"]] = record["peaks"][-1]
    estimate = bench.estimated(case)
    assert sorted(measured) == list(range(len(estimate)))
    for rank, want in enumerate(estimate):
        assert abs(want / measured[rank] - 1) <= TOLERANCE, (rank, want, measured[rank])
