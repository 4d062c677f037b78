"""``--dualpipe-max-activations K`` without a launch: K is a positive integer; a K below the
schedule's minimum is refused naming it, at argument validation when the micro-batch count is
known and else at the first step; a budget allows ``--dualpipe-stage-costs`` and alone optimizes
for the uniform costs. Training under a budget against 1F1B: test_megatron_training.py (the flag)
and test_megatron_dualpipe.py (``DualPipeOptions.max_activations``, losses and grads)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dualpipe_megatron.megatron import training_hooks
from dualpipe_megatron.megatron.schedule import DualPipeOptions, training_order
from dualpipe_megatron.schedules import build_schedule
from dualpipe_megatron.schedules.events import peak_live_activations
from dualpipe_megatron.schedules.optimize import optimize_order
from dualpipe_megatron.schedules.simulate import Costs, StageCosts

pytestmark = pytest.mark.slow


def _args(**kw: object) -> SimpleNamespace:
    """The parsed flags post_validate reads for the order (DualPipeV, P=2, M=8 unless changed)."""
    base = dict(pipeline_schedule="dualpipev", dualpipe_optimize_order=False, dualpipe_stage_costs=None,
                dualpipe_max_activations=None, global_batch_size=8, micro_batch_size=1, data_parallel_size=1)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_budget_must_be_a_positive_integer(value: str, capsys: pytest.CaptureFixture) -> None:
    parser = training_hooks.add_arguments(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--dualpipe-max-activations", value])
    assert "argument --dualpipe-max-activations" in capsys.readouterr().err
    assert parser.parse_args(["--dualpipe-max-activations", "3"]).dualpipe_max_activations == 3
    assert parser.parse_args([]).dualpipe_max_activations is None


def test_budget_below_the_minimum_is_refused_at_validation() -> None:
    with pytest.raises(ValueError, match=r"^--dualpipe-max-activations 1 is below the minimum 2: "):
        training_hooks._activation_budget(_args(dualpipe_max_activations=1), 2)
    assert training_hooks._activation_budget(_args(dualpipe_max_activations=2), 2) == 2
    assert training_hooks._activation_budget(_args(pipeline_schedule="dualpipe", dualpipe_max_activations=1),
                                               2) == 1
    assert training_hooks._activation_budget(_args(), 2) is None


def test_budget_below_the_minimum_is_refused_at_the_first_step_without_a_batch_size() -> None:
    args = _args(dualpipe_max_activations=1, global_batch_size=None)
    assert training_hooks._activation_budget(args, 2) == 1
    with pytest.raises(ValueError, match=r"^--dualpipe-max-activations 1 is below the minimum 2: "):
        training_order(DualPipeOptions(schedule="dualpipev", max_activations=1), 2, 8)


def test_budget_allows_stage_costs_and_alone_uses_the_uniform_costs(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(StageCosts.uniform(build_schedule("dualpipev", 2, 8), Costs.of()).to_json_obj()))
    got = training_hooks._optimization_costs(_args(dualpipe_stage_costs=str(path), dualpipe_max_activations=3), 2)
    assert isinstance(got, StageCosts)
    assert training_hooks._optimization_costs(_args(dualpipe_max_activations=3), 2) == Costs.of()
    assert training_hooks._optimization_costs(_args(), 2) is None
    with pytest.raises(ValueError, match="used by --dualpipe-optimize-order and --dualpipe-max-activations only"):
        training_hooks._optimization_costs(_args(dualpipe_stage_costs=str(path)), 2)


def test_budget_alone_runs_the_optimizers_order_within_it() -> None:
    """DualPipeV P=2, M=8: DeepSeek's order peaks above K = 4 on a rank; the job's order is the
    optimizer's for the uniform costs under K, and no rank exceeds it."""
    deepseek = build_schedule("dualpipev", 2, 8)
    budget = 4
    assert max(peak_live_activations(ops) for ops in deepseek.ops) > budget
    ran = training_order(DualPipeOptions(schedule="dualpipev", max_activations=budget), 2, 8)
    assert ran.ops == optimize_order(deepseek, Costs.of(), max_activations=budget).ops != deepseek.ops
    assert max(peak_live_activations(ops) for ops in ran.ops) <= budget
