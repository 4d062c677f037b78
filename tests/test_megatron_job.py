"""DualPipeJob's step-end actions: run in registration order, removed exactly (by identity)."""

from __future__ import annotations

import pytest

from dualpipe_megatron.megatron.job import DualPipeJob
from dualpipe_megatron.megatron.schedule import DualPipeOptions

pytestmark = pytest.mark.unit


def test_step_end_actions_run_in_order_and_removal_takes_exactly_one() -> None:
    job, calls = DualPipeJob(), []
    first = lambda chunks: calls.append(("first", chunks))  # noqa: E731
    second = lambda chunks: calls.append(("second", chunks))  # noqa: E731
    twin = lambda chunks: calls.append(("first", chunks))  # noqa: E731  (equal behaviour, other object)
    for action in (first, second, twin):
        job.add_step_end(action)
    job.run_step_end(["c"])
    assert calls == [("first", ["c"]), ("second", ["c"]), ("first", ["c"])]
    job.remove_step_end(first)
    assert job.step_end == [second, twin]
    with pytest.raises(ValueError, match="not registered"):
        job.remove_step_end(first)


def test_options_are_configuration_with_one_job_each() -> None:
    a, b = DualPipeOptions(schedule="dualpipe"), DualPipeOptions(schedule="dualpipe")
    assert a == b and a.job is not b.job  # the job is no part of the configuration
    a.job.last_stats = "stats"  # type: ignore[assignment]
    assert a.last_stats == "stats" and b.last_stats is None and a.mirror_group is None
    assert "job" not in repr(a)
