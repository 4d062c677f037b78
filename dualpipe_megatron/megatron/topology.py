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
    num_layers: int, num_stages: int, layout: str | list | None = None, mtp_layers: int = 0
) -> list[list[LayerType]]:
    """Layer types per model stage: Megatron's layout string/list (in stage order) or an even
    split, with the ``mtp_layers`` MTP layers (``--mtp-num-layers``) at the loss stage."""
    if layout is None:
        if num_layers % num_stages:
            raise ScheduleError(
                f"num_layers ({num_layers}) is not divisible by the {num_stages} pipeline "
                f"stages; pass --dualpipe-layout to place layers unevenly"
            )
        per = num_layers // num_stages
        stages = [[LayerType.decoder] * per for _ in range(num_stages)]
        stages[0].insert(0, LayerType.embedding)
        stages[-1] += [LayerType.mtp] * mtp_layers + [LayerType.loss]
        return stages
    parsed = PipelineParallelLayerLayout.parse_str_to_list(layout) if isinstance(layout, str) else layout
    if len(parsed) != num_stages:
        raise ScheduleError(
            f"pipeline layout has {len(parsed)} stages; this schedule needs {num_stages}"
        )
    stages = [[t if isinstance(t, LayerType) else LayerType[t.strip().lower()] for t in st]
              for st in parsed]
    problems = layout_problems(stages, num_layers, mtp_layers)
    if problems:
        raise ScheduleError(f"pipeline layout {layout!r}: " + "; ".join(problems))
    return stages


def layout_problems(stages: list[list[LayerType]], num_layers: int, mtp_layers: int) -> list[str]:
    """Why per-stage layer types (in model-stage order) are not a model our chunks can hold.

    The embedding opens the first stage and the loss closes the last; MTP layers follow every
    decoder layer and sit with the loss, where the embedding and output layer are at hand
    (DualPipeV's rank 0, each DualPipe direction's last stage).
    """
    flat = [t for stage in stages for t in stage]
    problems = []
    if flat.count(LayerType.embedding) != 1 or stages[0][:1] != [LayerType.embedding]:
        problems.append("the embedding (E) must open the first stage, once")
    if flat.count(LayerType.loss) != 1 or stages[-1][-1:] != [LayerType.loss]:
        problems.append("the loss (L) must close the last stage, once")
    if flat.count(LayerType.decoder) != num_layers:
        problems.append(f"{flat.count(LayerType.decoder)} decoder layers (t) for --num-layers {num_layers}")
    if flat.count(LayerType.mtp) != mtp_layers:
        problems.append(f"{flat.count(LayerType.mtp)} MTP layers (m) for --mtp-num-layers {mtp_layers}")
    elif mtp_layers and stages[-1][-1 - mtp_layers:-1] != [LayerType.mtp] * mtp_layers:
        problems.append("the MTP layers (m) must sit together just before the loss (L), in the last stage")
    return problems


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

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: int | None) -> bool:
        """Megatron's check assumes looped placement (MTP in a rank's last chunk, never on the
        first rank); ours is by model stage. Returns Megatron's ``mtp_standalone``, which only
        its own p2p reads (our schedules use their own)."""
        problems = layout_problems(self.stage_layers, num_layers, mtp_num_layers or 0)
        if problems:
            raise ValueError(f"pipeline layout {self!r}: " + "; ".join(problems))
        return False

    def __repr__(self) -> str:
        return layout_text(self.stage_layers)

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


def layout_text(stage_layers: list[list[LayerType]]) -> str:
    """Stages as Megatron's layout string writes them (``Ett|tt|tmL``)."""
    return "|".join("".join(_CHAR[t] for t in stage) for stage in stage_layers)
