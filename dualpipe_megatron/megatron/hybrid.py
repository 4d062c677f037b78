"""HybridModel's ``--hybrid-layer-pattern`` read as our model stages.

One rule: the main pattern's ``|`` segments are the model stages in model order (segment ``i``
is stage ``i``, which DualPipeV puts on rank ``min(i, 2P-1-i)``), so a pattern with ``|`` has
exactly one segment per stage (2P for dualpipev, P for dualpipe); a pattern without ``|`` is
split evenly. ``--dualpipe-layout`` does not apply (the pattern already says where layers go).
The embedding opens stage 0; the MTP depths (``/...``) and the loss close the last stage.

Megatron's own segment choice (``select_pipeline_segment``) assumes looped placement (segment
``vp*P + pp``); while a stage map is active it answers by this rule instead (``predicates``),
keeping every layer's global number.
"""

from __future__ import annotations

from typing import Any

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern

from ..schedules import ScheduleError


def layer_pattern(args: Any) -> str | None:
    """The job's hybrid pattern (``--hybrid-layer-pattern``, or its deprecated spelling), None for
    a GPT model."""
    return getattr(args, "hybrid_layer_pattern", None) or getattr(args, "hybrid_override_pattern", None)


def stage_segments(pattern: str, num_stages: int) -> list[str]:
    """The layer symbols of each model stage (see the module's rule)."""
    main = parse_hybrid_pattern(pattern).main_pattern or ""
    if Symbols.PIPE in main:
        segments = main.split(Symbols.PIPE)
        if len(segments) != num_stages:
            raise ScheduleError(
                f"--hybrid-layer-pattern {pattern!r} has {len(segments)} '|' segments; this schedule runs "
                f"{num_stages} model stages, one segment each in model order (or give no '|' for an even split)")
        return segments
    if len(main) % num_stages:
        raise ScheduleError(
            f"--hybrid-layer-pattern {pattern!r}: {len(main)} layers do not split evenly over {num_stages} model "
            f"stages; mark the {num_stages} stages with '|'")
    per = len(main) // num_stages
    return [main[i * per:(i + 1) * per] for i in range(num_stages)]


def stage_layout(pattern: str, num_stages: int) -> tuple[int, str, int]:
    """(decoder layers, Megatron layout string, MTP layers) of the pattern's stages: every symbol
    one decoder layer (``t``), so the stage map's :class:`~.topology.DualPipeLayout` follows."""
    segments = stage_segments(pattern, num_stages)
    depths = parse_hybrid_pattern(pattern).mtp_num_depths
    stages = ["t" * len(s) for s in segments]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * depths + "L"
    return sum(map(len, segments)), "|".join(stages), depths


__all__ = ["layer_pattern", "stage_layout", "stage_segments"]
