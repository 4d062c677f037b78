"""Where each model stage lives, and Megatron's layer layout for V-shaped and mirrored chunks.

Megatron maps stage ``vp*P + pp`` to rank ``pp``, chunk ``vp`` and assumes the
first stage is on the first rank and the last on the last. DualPipeV puts both
on rank 0; DualPipe puts a full copy of the model in each direction. The
:class:`StageMap` answers "which model stage is chunk ``vp`` of rank ``pp``"
from the schedule's own placement, and :class:`DualPipeLayout` feeds that
answer to Megatron's layer numbering, so every layer keeps its global number.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from ..schedules import Schedule, ScheduleError


@dataclass(frozen=True)
class StageMap:
    """Model stage of every (pipeline rank, chunk): chunk ``c`` of a rank is the
    ``c``-th of its (direction, stage) pairs in (direction, stage) order."""

    ranks: int
    num_stages: int
    chunk_stages: tuple[tuple[int, ...], ...]  # [rank][chunk] -> model stage

    @classmethod
    def of(cls, sched: Schedule) -> "StageMap":
        per_rank = tuple(tuple(s for _, s in sched.stages_on(r)) for r in range(sched.ranks))
        return cls(sched.ranks, sched.stages, per_rank)

    @property
    def chunks(self) -> int:
        return len(self.chunk_stages[0])

    def stage(self, rank: int, chunk: int) -> int:
        return self.chunk_stages[rank][chunk]

    def is_first(self, rank: int, chunk: int) -> bool:
        """Holds the embedding (Megatron's ``pre_process``)."""
        return self.stage(rank, chunk) == 0

    def is_last(self, rank: int, chunk: int) -> bool:
        """Holds the output layer and the loss (Megatron's ``post_process``)."""
        return self.stage(rank, chunk) == self.num_stages - 1


def stage_layer_types(
    num_layers: int, num_stages: int, layout: str | list | None = None
) -> list[list[LayerType]]:
    """Layer types per model stage: Megatron's layout string/list (in stage order) or an even split."""
    if layout is None:
        if num_layers % num_stages:
            raise ScheduleError(
                f"num_layers ({num_layers}) is not divisible by the {num_stages} pipeline "
                f"stages; pass --pipeline-model-parallel-layout to place layers unevenly"
            )
        per = num_layers // num_stages
        stages = [[LayerType.decoder] * per for _ in range(num_stages)]
        stages[0].insert(0, LayerType.embedding)
        stages[-1].append(LayerType.loss)
        return stages
    parsed = PipelineParallelLayerLayout.parse_str_to_list(layout) if isinstance(layout, str) else layout
    if len(parsed) != num_stages:
        raise ScheduleError(
            f"pipeline layout has {len(parsed)} stages; this schedule needs {num_stages}"
        )
    return [[t if isinstance(t, LayerType) else LayerType[t.strip().lower()] for t in st]
            for st in parsed]


class DualPipeLayout(PipelineParallelLayerLayout):
    """A :class:`PipelineParallelLayerLayout` whose chunks follow a :class:`StageMap`.

    ``layout[pp][vp]`` is the stage that chunk ``vp`` of rank ``pp`` holds and
    the layer offset counts the layers of all earlier *model* stages, so
    Megatron's layer numbers, sharded-state-dict keys and MTP placement follow.
    """

    def __init__(self, stage_layers: list[list[LayerType]], stage_map: StageMap) -> None:
        if len(stage_layers) != stage_map.num_stages:
            raise ScheduleError(
                f"{len(stage_layers)} stage layouts for {stage_map.num_stages} stages"
            )
        self.input_data = stage_layers
        self.stage_map = stage_map
        self.stage_layers = [list(s) for s in stage_layers]
        self.pipeline_model_parallel_size = stage_map.ranks
        self.virtual_pipeline_model_parallel_size = stage_map.chunks
        self.layout = [
            [self.stage_layers[stage_map.stage(r, c)] for c in range(stage_map.chunks)]
            for r in range(stage_map.ranks)
        ]
        self.flatten_layout = [t for stage in self.stage_layers for t in stage]

    def __repr__(self) -> str:
        return "|".join("".join(_CHAR[t] for t in s) for s in self.stage_layers)

    def get_layer_offset(
        self,
        layer_type: LayerType = LayerType.decoder,
        vp_stage: int | None = None,
        pp_rank: int | None = None,
    ) -> int:
        if pp_rank is None:
            from megatron.core import parallel_state

            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        stage = self.stage_map.stage(pp_rank, vp_stage or 0)
        return sum(s.count(layer_type) for s in self.stage_layers[:stage])


_CHAR = {LayerType.embedding: "E", LayerType.loss: "L", LayerType.decoder: "t", LayerType.mtp: "m"}
