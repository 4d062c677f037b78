"""Calibrated projection: measured op costs plus a communication model, fed to the simulator."""

from .comm import Network, a2a_ms, p2p_ms
from .costs import StageTimes, schedule_costs, stage_times
from .count import ChunkCount, count_chunk
from .measure import OpCosts, measure
from .placement import FromFile, Realistic, Uniform
from .project import VARIANTS, Projection, megatron_combined_1f1b, project, project_order, variants
from .shapes import DEEPSEEK_V3, DEEPSEEK_V3_STAGE, PRESETS, ProjectionError, stage_shape, whole_model

__all__ = [
    "ChunkCount", "DEEPSEEK_V3", "DEEPSEEK_V3_STAGE", "FromFile", "Network", "OpCosts", "PRESETS",
    "Projection", "ProjectionError", "Realistic", "StageTimes", "Uniform", "VARIANTS", "a2a_ms",
    "count_chunk", "measure", "megatron_combined_1f1b", "p2p_ms", "project", "project_order", "schedule_costs",
    "stage_shape", "stage_times", "variants", "whole_model",
]
