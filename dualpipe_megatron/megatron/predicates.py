"""Stage predicates that know where DualPipe puts the first and last stages.

Megatron's ``parallel_state.is_pipeline_first_stage``/``is_pipeline_last_stage``
are index tests (rank 0 / rank P-1, chunk 0 / chunk V-1). Data loading
(``get_batch``), ``forward_step_calc_loss``'s fallback and MTP ask them, and
under DualPipeV rank 0 holds both the first stage (chunk 0) and the last (chunk 1).
While a :class:`StageMap` is active the patched predicates answer from it:
for an explicit ``vp_stage``, for the chunk our schedule is running (set with
:func:`running_chunk`), or, with neither, for any chunk on this rank.

The pg-based ``pipeline_parallel.utils.is_pp_first_stage``/``is_pp_last_stage``
keep their meaning (rank topology) and are not touched; only the MTP module's own
copy of ``is_vp_last_stage`` answers for our placement (see ``_install_mtp_placement``),
``Float16Module`` casts to fp32 the output of the chunks the map calls last
(see ``_install_float16_placement``), and a HybridModel chunk builds the layers of its model stage
(see ``_install_hybrid_segments``).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

from megatron.core import parallel_state

from ..patch_guard import PatchSet
from .hybrid import stage_segments
from .topology import StageMap

_active: list[StageMap] = []  # entered around each step (innermost last)
_job: list[StageMap] = []  # at most one: the training job's placement, between steps too
_chunk: ContextVar[int | None] = ContextVar("dualpipe_running_chunk", default=None)
PATCHES = PatchSet("stage predicates")


def active_stage_map() -> StageMap | None:
    return _active[-1] if _active else (_job[0] if _job else None)


@contextmanager
def stage_map_active(stage_map: StageMap) -> Iterator[None]:
    """Make the predicates answer from ``stage_map`` while a step runs (nestable; restores on exit)."""
    install_predicates()
    _active.append(stage_map)
    try:
        yield
    finally:
        _active.pop()


def set_job_stage_map(stage_map: StageMap | None) -> None:
    """The placement the predicates answer from outside steps too (model building, data loading,
    logging in Megatron's training loop); ``None`` restores Megatron's own answers."""
    if stage_map is not None:
        install_predicates()
    _job[:] = [stage_map] if stage_map is not None else []


@contextmanager
def running_chunk(chunk: int) -> Iterator[None]:
    """Mark ``chunk`` as the one whose forward step is running on this rank."""
    token = _chunk.set(chunk)
    try:
        yield
    finally:
        _chunk.reset(token)


def _answer(test: Callable[[StageMap, int, int], bool], ignore_virtual: bool, vp_stage: int | None) -> bool:
    stage_map = active_stage_map()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    chunk = vp_stage if (vp_stage is not None and not ignore_virtual) else _chunk.get()
    if chunk is not None:
        return test(stage_map, rank, chunk)
    return any(test(stage_map, rank, c) for c in range(stage_map.chunks))


def install_predicates() -> None:
    """Patch the two ``parallel_state`` predicates (idempotent; inert while no map is active)."""
    for name, test in (("is_pipeline_first_stage", StageMap.is_first),
                       ("is_pipeline_last_stage", StageMap.is_last)):
        if PATCHES.is_patched(parallel_state, name):
            continue
        original = getattr(parallel_state, name)

        def predicate(ignore_virtual: bool = True, vp_stage: int | None = None,
                      _original: Callable = original, _test: Callable = test) -> bool:
            if active_stage_map() is None:
                return _original(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
            return _answer(_test, ignore_virtual, vp_stage)

        PATCHES.patch(parallel_state, name, predicate, "(ignore_virtual=True, vp_stage=None)")
    _install_mtp_placement()
    _install_float16_placement()
    _install_hybrid_segments()


def _install_mtp_placement() -> None:
    """Megatron's MTP block asserts it is built in a rank's *last* chunk (looped placement); ours
    sits at the loss stage, which DualPipe's last rank holds in chunk 0. While a stage map is
    active the MTP module's ``is_vp_last_stage`` answers "holds the last model stage"."""
    from megatron.core.transformer import multi_token_prediction as mtp

    if PATCHES.is_patched(mtp, "is_vp_last_stage"):
        return
    original = mtp.is_vp_last_stage

    def is_vp_last_stage(vp_stage: int, vp_size: int | None) -> bool:
        stage_map = active_stage_map()
        if stage_map is None or vp_stage is None:
            return original(vp_stage=vp_stage, vp_size=vp_size)
        return stage_map.is_last(parallel_state.get_pipeline_model_parallel_rank(), vp_stage)

    PATCHES.patch(mtp, "is_vp_last_stage", is_vp_last_stage, "(vp_stage, vp_size)")


def _install_float16_placement() -> None:
    """fp16/bf16: Megatron's ``Float16Module`` casts the output of rank P-1's last chunk to fp32,
    taking it for the loss stage. Under DualPipeV that chunk is the middle of the V, under
    DualPipe direction 1's first stage: their output goes over p2p in the pipeline dtype. While
    a stage map is active the cast applies to the chunks the map calls last, and only to them.
    (Its first-stage input cast is left as is: it converts float inputs only, and a GPT first
    stage takes token ids.)"""
    from megatron.core.transformer.module import Float16Module, float16_to_fp32

    if PATCHES.is_patched(Float16Module, "forward"):
        return
    original = Float16Module.forward

    def forward(self, *inputs, fp32_output: bool = True, **kwargs):
        stage_map = active_stage_map()
        if stage_map is None:
            return original(self, *inputs, fp32_output=fp32_output, **kwargs)
        outputs = original(self, *inputs, fp32_output=False, **kwargs)
        last = stage_map.is_last(parallel_state.get_pipeline_model_parallel_rank(), self.vp_stage or 0)
        return float16_to_fp32(outputs) if fp32_output and last else outputs

    PATCHES.patch(Float16Module, "forward", forward, "(self, *inputs, fp32_output=True, **kwargs)")


def _install_hybrid_segments() -> None:
    """A HybridModel chunk builds its layers from Megatron's ``select_pipeline_segment``, which reads
    the pattern's ``|`` segments as looped placement (segment ``vp*P + pp``). While a stage map is
    active it gives the layers of the model stage the chunk holds (:mod:`.hybrid`'s rule) and the
    count of layers before it, so every layer keeps its global number."""
    from megatron.core.models.hybrid import hybrid_layer_allocation as allocation

    if PATCHES.is_patched(allocation, "select_pipeline_segment"):
        return
    original = allocation.select_pipeline_segment

    def select_pipeline_segment(main_pattern, pp_group, vp_stage, *args, **kwargs):
        stage_map = active_stage_map()
        if stage_map is None:
            return original(main_pattern, pp_group, vp_stage, *args, **kwargs)
        segments = stage_segments(main_pattern, stage_map.num_stages)
        stage = stage_map.stage(pp_group.rank(), vp_stage or 0)
        return allocation.validate_segment_layers(segments[stage]), sum(map(len, segments[:stage]))

    PATCHES.patch(allocation, "select_pipeline_segment", select_pipeline_segment,
                  "(main_pattern, pp_group, vp_stage, first_stage_layers=None, last_stage_layers=None, "
                  "tp_group=None, dp_cp_group=None)")
