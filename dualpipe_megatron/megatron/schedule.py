"""DualPipe and DualPipeV as a Megatron-Core ``forward_backward_func``.

The op order comes from :mod:`dualpipe_megatron.schedules` and is executed by
:mod:`dualpipe_megatron.runtime`; this module only adapts Megatron's contracts:
each chunk's forward runs through Megatron's own ``forward_step`` (loss
scaling by the number of micro-batches, MoE aux-loss and MTP scales, per-token
loss, ``forward_data_store``), the step runs under ``no_sync``, ties and
mirrored copies are reduced before ``finalize_model_grads_func``, and the loss
reports are handed to the last pipeline rank, where ``train_step`` reads them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as mcore_schedules
from megatron.core.utils import get_model_config

from ..runtime.executor import Executor, StepData, StepStats
from ..runtime.p2p import DistTransport, P2P
from ..runtime.plan import MessagePlan
from ..schedules import Schedule, ScheduleError, build_schedule, validate
from ..trace.recorder import OpTracer
from .grads import sum_mirrored_grads, sum_tied_embedding_grads
from .predicates import running_chunk, stage_map_active
from .topology import StageMap
from .wgrad_megatron import install_linear_deferral
from .wgrad_te import delayed_wgrad_problems, install_delayed_wgrad_deferral

SCHEDULES = ("dualpipev", "dualpipe")


@dataclass
class DualPipeOptions:
    """How our forward_backward_func runs; one instance per training job."""

    schedule: str = "dualpipev"
    timeout: float = 600.0
    debug_p2p: bool = False
    defer_weight_grads: bool = True  # B(w:false) defers Megatron linears' weight grads to its W
    trace_dir: str | None = None  # record every executed op (see dualpipe_megatron.trace)
    moe_overlap: bool = True  # MoE (EP > 1): FB ops overlap F and B layer by layer (moe_overlap.py)
    mirror_group: dist.ProcessGroup | None = None  # DualPipe only, from prepare_model
    last_stats: StepStats | None = None  # the executor's counters of the latest step
    _plans: dict = field(default_factory=dict)
    _tracer: OpTracer | None = field(default=None, repr=False)  # created on the first step when tracing


def stage_map_for(schedule: str, ranks: int) -> StageMap:
    """Placement of model stages on (rank, chunk); independent of the micro-batch count."""
    return StageMap.of(build_schedule(schedule, ranks, 2 * ranks))


def unsupported_options(config: Any, forward_only: bool, collect_non_loss_data: bool,
                        adjust_tensor_shapes_fn: Callable | None) -> list[str]:
    """Megatron options our schedules do not run yet, each with the reason."""
    reasons = []
    if config.variable_seq_lengths:
        reasons.append("variable_seq_lengths (p2p shapes must be fixed)")
    if getattr(config, "mtp_num_layers", None):
        reasons.append("multi-token prediction (MTP placement on V-shaped chunks is not wired)")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        reasons.append("defer_embedding_wgrad_compute")
    if collect_non_loss_data:
        reasons.append("collect_non_loss_data")
    if adjust_tensor_shapes_fn is not None:
        reasons.append("adjust_tensor_shapes_fn")
    return reasons


class _DirectionView:
    """A chunk's data iterator seen by one DualPipe direction.

    Direction ``d`` handles micro-batches ``[offset, offset + count)`` of the
    ``total`` the iterator yields per step. It skips lazily, so a chunk whose
    forward step never reads its iterator (a middle stage) never consumes it.
    """

    def __init__(self, it: Iterator, offset: int, count: int, total: int) -> None:
        self.it, self.offset, self.count, self.total = it, offset, count, total
        self.taken = 0

    def __iter__(self) -> "_DirectionView":
        return self

    def __next__(self) -> Any:
        if self.taken == 0:
            for _ in range(self.offset):
                next(self.it)
        self.taken += 1
        return next(self.it)

    def finish(self) -> None:
        """Leave the iterator at the start of the next step, as Megatron's schedules do."""
        if self.taken:
            for _ in range(self.total - self.offset - self.taken):
                next(self.it)


@dataclass
class _Step:
    """What every stage callable of one step shares."""

    forward_step_func: Callable
    model: Sequence[nn.Module]
    iterators: list[Any]
    config: Any
    num_microbatches: int
    cp_size: int
    forward_only: bool
    first_val_step: bool | None
    stores: dict[int, list] = field(default_factory=dict)
    num_tokens: torch.Tensor = field(default_factory=lambda: torch.tensor(0, dtype=torch.int))


class _MegatronStage:
    """Stage ``(d, s)`` held in chunk ``chunk``, called by the executor like a module.

    Its input is the received activation (none on the first stage); it runs
    Megatron's ``forward_step`` for the next micro-batch of its direction and
    returns the stage output, or on the last stage the (grad-scaled) loss the
    executor starts the backward from.
    """

    def __init__(self, step: _Step, chunk: int, d: int, is_last: bool, offset: int) -> None:
        self.step, self.chunk, self.d, self.is_last, self.offset = step, chunk, d, is_last, offset
        self.calls = 0

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        step, m = self.step, self.calls
        self.calls += 1
        first = mcore_schedules.check_first_val_step(step.first_val_step, step.forward_only, m == 0)
        with running_chunk(self.chunk):
            output, num_tokens = mcore_schedules.forward_step(
                step.forward_step_func, step.iterators[self.chunk], step.model[self.chunk],
                step.num_microbatches, inputs[0] if inputs else None,
                step.stores.setdefault(self.d, []), step.config, step.cp_size,
                is_first_microbatch=first, current_microbatch=self.offset + m,
                vp_stage=self.chunk, is_last_stage=self.is_last,
            )
        if not self.is_last:
            return output
        step.num_tokens += num_tokens
        if not step.forward_only and step.config.grad_scale_func is not None:
            output = step.config.grad_scale_func(output)
        return output


def _as_list(x: Any, n: int) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x] * n


@contextlib.contextmanager
def _no_sync(config: Any, chunks: int) -> Iterator[None]:
    """Keep DDP from reducing grads mid-step: mirrored and tied grads are summed first."""
    funcs = _as_list(config.no_sync_func, chunks) if config.no_sync_func is not None else []
    with contextlib.ExitStack() as stack:
        for func in funcs:
            stack.enter_context(func())
        yield


def _relay_to_last_rank(sched: Schedule, rank: int, stores: dict[int, list], group: dist.ProcessGroup) -> list:
    """Loss reports of all directions, in global micro-batch order, on the last pipeline rank."""
    last = sched.ranks - 1
    gathered: list = []
    for d in range(sched.directions):
        src = sched.rank_of(d, sched.stages - 1)
        if src == last:
            gathered += stores.get(d, []) if rank == last else []
            continue
        box = [stores.get(d, []) if rank == src else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, src), group=group)
        gathered += box[0] if rank == last else []
    return gathered


def _schedule(options: DualPipeOptions, ranks: int, microbatches: int, forward_only: bool,
              rank: int) -> tuple[Schedule, MessagePlan]:
    key = (ranks, microbatches, forward_only, rank)
    if key not in options._plans:
        try:
            sched = build_schedule(options.schedule, ranks, microbatches)
        except ScheduleError as exc:
            raise ValueError(f"--pipeline-schedule {options.schedule}: {exc}") from None
        validate(sched)
        options._plans[key] = (sched, MessagePlan.build(sched, rank, forward_only))
    return options._plans[key]


def _tracer(options: DualPipeOptions, group: dist.ProcessGroup) -> OpTracer | None:
    """This process's op tracer when ``options.trace_dir`` is set (one file per process and job)."""
    if options.trace_dir is not None and options._tracer is None:
        options._tracer = OpTracer.for_group(options.trace_dir, group)
    return options._tracer


def make_forward_backward_func(options: DualPipeOptions) -> Callable[..., list]:
    """A function with the keyword signature of Megatron's schedules, running ``options.schedule``."""
    if options.schedule not in SCHEDULES:
        raise ValueError(f"unknown DualPipe schedule {options.schedule!r}; choose from {SCHEDULES}")
    if options.defer_weight_grads:
        install_linear_deferral()
        install_delayed_wgrad_deferral()

    def forward_backward_dualpipe(
        *,
        forward_step_func: Callable,
        data_iterator: Any,
        model: nn.Module | Sequence[nn.Module],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn: Callable | None = None,
        p2p_communicator: Any = None,
        pg_collection: Any = None,
        force_all_reduce: bool | None = False,
    ) -> list:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        config = get_model_config(chunks[0])
        reasons = unsupported_options(config, forward_only, collect_non_loss_data, adjust_tensor_shapes_fn)
        if reasons:
            raise ValueError(f"--pipeline-schedule {options.schedule} does not support: " + "; ".join(reasons))
        if pg_collection is None:
            pg_collection = mcore_schedules._build_default_pg_collection()
        group = pg_collection.pp
        ranks, rank = group.size(), group.rank()
        sched, plan = _schedule(options, ranks, num_microbatches, forward_only, rank)
        stage_map = StageMap.of(sched)
        if len(chunks) != stage_map.chunks:
            raise ValueError(
                f"--pipeline-schedule {options.schedule} needs {stage_map.chunks} model chunks per "
                f"rank (virtual pipeline size {stage_map.chunks}), got {len(chunks)}"
            )
        if config.param_sync_func is not None:
            for c, func in enumerate(_as_list(config.param_sync_func, len(chunks))):
                func(chunks[c].parameters())

        per_direction = num_microbatches // sched.directions
        step = _Step(forward_step_func, chunks, [], config, num_microbatches, pg_collection.cp.size(),
                     forward_only, first_val_step)
        stages: dict[tuple[int, int], _MegatronStage] = {}
        # -- MoE F&B overlap (moe_overlap.py): plan-built stages and the executor's FB hook --
        from .moe_overlap import MoEOverlapStage, announce_overlap, overlap_enabled

        overlap = overlap_enabled(options.moe_overlap, config, chunks, forward_step_func, forward_only)
        stage_cls = MoEOverlapStage if overlap else _MegatronStage
        problems = delayed_wgrad_problems(config, sched, rank, overlap, options.defer_weight_grads,
                                          forward_only)
        if problems:
            raise ValueError(f"--pipeline-schedule {options.schedule}: " + "; ".join(problems))
        # -- end MoE F&B overlap --
        views: list[_DirectionView] = []
        for c, (d, s) in enumerate(sched.stages_on(rank)):
            it = _as_list(data_iterator, len(chunks))[c]
            if sched.directions > 1 and it is not None:
                it = _DirectionView(it, d * per_direction, per_direction, num_microbatches)
                views.append(it)
            step.iterators.append(it)
            stages[(d, s)] = stage_cls(step, c, d, s == sched.stages - 1, d * per_direction)

        shapes = mcore_schedules.get_tensor_shapes(
            seq_length=seq_length, micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length, config=config, tp_group=pg_collection.tp,
            cp_group=pg_collection.cp,
        )
        device = next(chunks[0].parameters()).device
        p2p = P2P(DistTransport(group, list(range(ranks))), rank, device, lambda edge: shapes,
                  config.pipeline_dtype, options.timeout, options.debug_p2p)
        executor = Executor(sched, rank, stages, p2p, defer_weight_grads=options.defer_weight_grads,
                            use_overlap_hook=overlap)
        executor.observer = _tracer(options, group)
        empty = {d: [() for _ in range(per_direction)] for d in range(sched.directions)}
        data = StepData(inputs=empty, labels=empty, criterion=lambda loss: loss,
                        return_outputs=False, forward_only=forward_only)

        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        with stage_map_active(stage_map), _no_sync(config, len(chunks)):
            if forward_only:
                with torch.no_grad():
                    executor.run(plan, data)
            else:
                executor.run(plan, data)
        options.last_stats = executor.stats
        if overlap:
            announce_overlap(executor.stats.overlapped, sched.ops[rank])
        for view in views:
            view.finish()

        if not forward_only:
            sum_tied_embedding_grads(chunks, stage_map, rank)
            if sched.directions > 1:
                if options.mirror_group is None:
                    raise RuntimeError("dualpipe: call prepare_model() once after building the model")
                sum_mirrored_grads(chunks, stage_map, rank, options.mirror_group)
            if config.grad_sync_func is not None:
                for c, func in enumerate(_as_list(config.grad_sync_func, len(chunks))):
                    func(chunks[c].parameters())
            if config.finalize_model_grads_func is not None:
                # Only ranks holding a last stage counted tokens; every rank needs the total.
                total = step.num_tokens.clone()
                dist.all_reduce(total, group=group)
                config.finalize_model_grads_func(
                    chunks, total if config.calculate_per_token_loss else None,
                    pg_collection=pg_collection, force_all_reduce=force_all_reduce,
                )
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return _relay_to_last_rank(sched, rank, step.stores, group)

    return forward_backward_dualpipe
