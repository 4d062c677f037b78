"""Pipeline schedules as data: generators, validator, simulator, drawing and CLI."""

from .ir import B, F, FB, Key, Op, Schedule, ScheduleError, W
from .registry import GENERATORS, build_schedule
from .simulate import Costs, SimResult, simulate
from .validate import ValidationError, validate

__all__ = [
    "B", "F", "FB", "Key", "Op", "Schedule", "ScheduleError", "W",
    "GENERATORS", "build_schedule", "Costs", "SimResult", "simulate",
    "ValidationError", "validate",
]
