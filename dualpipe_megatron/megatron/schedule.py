"""DualPipe and DualPipeV as a Megatron-Core ``forward_backward_func``.

The op order comes from :mod:`dualpipe_megatron.schedules` and is executed by
:mod:`dualpipe_megatron.runtime`; this module only adapts Megatron's contracts,
in three steps: :func:`plan_step` checks the call and picks the schedule, the
stages and the MoE overlap; :func:`run_step` executes the op list, each chunk's
forward through Megatron's own ``forward_step`` (loss scaling by the number of
micro-batches, MoE aux-loss and MTP scales, per-token loss,
``forward_data_store``) under ``no_sync``; :func:`finish_step` runs the job's
step-end actions (:mod:`.job`), sums tied and mirrored gradients before
``finalize_model_grads_func`` and hands the loss
reports to the last pipeline rank, where ``train_step`` reads them.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.pipeline_parallel import schedules as mcore_schedules
from megatron.core.utils import get_model_config

from ..runtime.agreement import check_plan_agreement
from ..runtime.executor import Executor, StepStats
from ..runtime.p2p import DistTransport, P2P
from ..runtime.plan import MessagePlan
from ..runtime.shared_search import RankWorkers
from ..schedules import Schedule, ScheduleError, build_schedule, simulate, validate
from ..schedules.optimize import min_activations, optimize_order
from ..schedules.order_file import order_for_job
from ..schedules.simulate import Costs, StageCosts
from ..trace.recorder import OpTracer
from .grads import (
    mirrored_expert_bias_mismatches, sum_mirrored_expert_token_counts, sum_mirrored_grads, sum_tied_embedding_grads,
)
from .guard import check_private_symbols
from .job import DualPipeJob
from .moe_overlap import MoEOverlapHandlers, announce_overlap, layers_to_announce, overlap_enabled
from .mtp import recording_mtp_metrics, replay_mtp_metrics
from .predicates import stage_map_active
from .relay import relay
from .stages import MegatronHandlers, MegatronStep, MicrobatchData
from .refusals import (
    SCHEDULES, UNBUILT, chunk_role_problems, delayed_wgrad_problems, stage_map_for, step_problems,
)
from .topology import StageMap


@dataclass
class DualPipeOptions:
    """How our forward_backward_func runs (user configuration); one instance per training job."""

    schedule: str = "dualpipev"
    timeout: float = 600.0
    debug_p2p: bool = False
    defer_weight_grads: bool = True  # B(w:false) defers Megatron linears' weight grads to its W
    trace_dir: str | None = None  # record every executed op (see dualpipe_megatron.trace)
    moe_overlap: bool = True  # MoE (EP > 1): FB ops overlap F and B layer by layer (moe_overlap.py)
    # Run the op order optimized for these costs (schedules/optimize.py) instead of DeepSeek's;
    # None: DeepSeek's order. Costs or StageCosts (the same on every rank: the result is too).
    optimize_for: Costs | StageCosts | None = None
    # Activation budget (--dualpipe-max-activations): the fastest order found with at most this many
    # live (d,s,m) stage activations on every rank (schedules/optimize.py), for optimize_for or,
    # when that is None, the uniform costs; None: no budget.
    max_activations: int | None = None
    # --dualpipe-schedule-file: run the order in this schedule JSON (schedules/order_file.py),
    # checked against the job's shape; None: DeepSeek's order or the optimized one above.
    schedule_file: str | None = None
    # The job these options run (what the schedule keeps between steps, its step-end actions):
    # not configuration, the handle through which prepare_model and every step reach the same job.
    job: DualPipeJob = field(default_factory=DualPipeJob, init=False, repr=False, compare=False)

    @property
    def mirror_group(self) -> dist.ProcessGroup | None:
        return self.job.mirror_group

    @property
    def last_stats(self) -> StepStats | None:
        return self.job.last_stats


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


def _relay_to_last_rank(sched: Schedule, rank: int, step: MegatronStep, group: dist.ProcessGroup,
                        layouts: dict) -> list:
    """Loss reports of all directions, in global micro-batch order, on the last pipeline rank
    (a report layout is sent once per direction and program, then only its tensors: relay.py)."""
    last = sched.ranks - 1
    gathered: list = []
    for d in range(sched.directions):
        src = sched.rank_of(d, sched.stages - 1)
        if src == last:
            gathered += step.reports(d) if rank == last else []
            continue
        reports = relay(step.reports(d) if rank == src else None, src, group, layouts,
                        (d, sched.microbatches, step.forward_only), step.num_tokens.device)
        gathered += reports if rank == last else []
    return gathered


@dataclass
class StepPlan:
    """Everything :func:`run_step` needs, decided before any compute or communication."""

    sched: Schedule
    plan: MessagePlan
    stage_map: StageMap
    group: dist.ProcessGroup
    rank: int
    chunks: list[nn.Module]
    config: Any
    pg_collection: Any
    overlap: bool
    shapes: list
    forward_only: bool
    overlap_layers: str  # what the overlap announcement names (moe_overlap.layers_to_announce)


def plan_for_step(options: DualPipeOptions, group: dist.ProcessGroup, microbatches: int, forward_only: bool,
              device: torch.device) -> tuple[Schedule, MessagePlan]:
    """This rank's plan, built once per program; the pipeline ranks prove they agree on it first."""
    ranks, rank = group.size(), group.rank()
    key = (ranks, microbatches, forward_only, rank)
    plans = options.job.plans
    if key not in plans:
        sched = options.job.schedules.get((ranks, microbatches))
        if sched is None:
            sched = options.job.schedules[(ranks, microbatches)] = training_order(options, ranks, microbatches,
                                                                                   group)
        check_plan_agreement(sched, forward_only, group, device)
        plans[key] = (sched, MessagePlan.build(sched, rank, forward_only))
    return plans[key]


def check_activation_budget(sched: Schedule, max_activations: int) -> None:
    """Refuse a budget that no order of ``sched``'s placement can meet, stating the minimum."""
    minimum = min_activations(sched)
    if max_activations < minimum:
        raise ValueError(f"--dualpipe-max-activations {max_activations} is below the minimum {minimum}: every "
                         f"order of {sched.name} at P={sched.ranks} keeps {minimum} stage activations "
                         f"(direction, stage, micro-batch) live on some rank")


def order_costs(options: DualPipeOptions) -> Costs | StageCosts | None:
    """The costs a job's order is optimized for: ``options.optimize_for``, the uniform costs when
    only a budget is set, None when the job runs DeepSeek's order."""
    if options.optimize_for is None and options.max_activations is None:
        return None
    return Costs.of() if options.optimize_for is None else options.optimize_for


def training_order(options: DualPipeOptions, ranks: int, microbatches: int,
                   group: dist.ProcessGroup | None = None) -> Schedule:
    """The op order a job with ``options`` runs: the one in ``options.schedule_file``, DeepSeek's,
    or the one optimized for ``options.optimize_for`` (the uniform costs when only a budget is set)
    within ``options.max_activations`` (said once on global rank 0). Public so that the launch
    plan plans this very order. With the pipeline ``group`` (a collective) its ranks share the
    search (runtime/shared_search.py): the same order, each rank running a part of it."""
    try:
        sched = build_schedule(options.schedule, ranks, microbatches)
    except ScheduleError as exc:
        raise ValueError(f"--pipeline-schedule {options.schedule}: {exc}") from None
    validate(sched)
    if options.schedule_file is not None:
        return file_order(options.schedule_file, sched)
    budget, costs = options.max_activations, order_costs(options)
    if costs is None:
        return sched
    if budget is not None:
        check_activation_budget(sched, budget)
    workers = (RankWorkers(group, {"schedule": sched.to_json(), "costs": repr(costs), "budget": repr(budget)})
               if group is not None and group.size() > 1 else None)
    try:
        optimized = optimize_order(sched, costs, max_activations=budget, workers=workers)
    except ScheduleError as exc:
        raise ValueError(f"--dualpipe-max-activations {budget}: {exc}") from None
    _say_order(f"DualPipe op order optimized ({options.schedule}, P={ranks}, M={microbatches})", sched,
               optimized, costs, f"activation budget {'none' if budget is None else f'{budget} per rank'}")
    return optimized


def file_order(path: str, deepseek: Schedule, announce: bool = True) -> Schedule:
    """The order in schedule file ``path``, refused unless it runs ``deepseek``'s shape (said on
    global rank 0 with ``announce``)."""
    try:
        sched = order_for_job(path, deepseek)
    except ScheduleError as exc:
        raise ValueError(f"--dualpipe-schedule-file {exc}") from None
    if announce:
        _say_order(f"DualPipe op order from {path} ({sched.name}, P={sched.ranks}, M={sched.microbatches})",
                   deepseek, sched, Costs.of(), "uniform costs")
    return sched


def _say_order(what: str, deepseek: Schedule, ran: Schedule, costs: Costs | StageCosts, note: str) -> None:
    """On global rank 0: the order's simulated step and per-rank activation peaks beside DeepSeek's."""
    if dist.is_initialized() and dist.get_rank() == 0:
        before, after = simulate(deepseek, costs), simulate(ran, costs)
        print(f"{what}: simulated step {float(before.makespan):.4g} -> {float(after.makespan):.4g}, peak "
              f"activations per rank {[r.peak_activations for r in before.per_rank]} -> "
              f"{[r.peak_activations for r in after.per_rank]}, {note}", flush=True)


def plan_step(options: DualPipeOptions, *, forward_step_func: Callable, model: nn.Module | Sequence[nn.Module],
              num_microbatches: int, seq_length: int, micro_batch_size: int, decoder_seq_length: int | None,
              forward_only: bool, collect_non_loss_data: bool, adjust_tensor_shapes_fn: Callable | None,
              pg_collection: Any) -> StepPlan:
    """Check one call and decide how it runs; raises ``ValueError`` naming every unsupported option."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not options.job.prepared:
        raise RuntimeError(f"--pipeline-schedule {options.schedule}: {UNBUILT}")
    config = get_model_config(chunks[0])
    reasons = step_problems(config, collect_non_loss_data, adjust_tensor_shapes_fn)
    if reasons:
        raise ValueError(f"--pipeline-schedule {options.schedule} does not support: " + "; ".join(reasons))
    if pg_collection is None:
        pg_collection = mcore_schedules._build_default_pg_collection()
    group = pg_collection.pp
    rank = group.rank()
    device = next(chunks[0].parameters()).device
    sched, plan = plan_for_step(options, group, num_microbatches, forward_only, device)
    stage_map = StageMap.of(sched)
    if len(chunks) != stage_map.chunks:
        raise ValueError(
            f"--pipeline-schedule {options.schedule} needs {stage_map.chunks} model chunks per "
            f"rank (virtual pipeline size {stage_map.chunks}), got {len(chunks)}"
        )
    misplaced = chunk_role_problems(chunks, stage_map, rank)
    if misplaced:
        raise RuntimeError(f"--pipeline-schedule {options.schedule}: " + "; ".join(misplaced) + f". {UNBUILT}")
    overlap = overlap_enabled(options.moe_overlap, config, chunks, forward_step_func, forward_only)
    problems = delayed_wgrad_problems(config, sched, rank, overlap, options.defer_weight_grads, forward_only)
    if problems:
        raise ValueError(f"--pipeline-schedule {options.schedule}: " + "; ".join(problems))
    shapes = mcore_schedules.get_tensor_shapes(
        seq_length=seq_length, micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length, config=config, tp_group=pg_collection.tp,
        cp_group=pg_collection.cp,
    )
    return StepPlan(sched, plan, stage_map, group, rank, chunks, config, pg_collection, overlap, shapes,
                    forward_only, layers_to_announce(chunks) if overlap else "")


def _tracer(options: DualPipeOptions, group: dist.ProcessGroup) -> OpTracer | None:
    """This process's op tracer when ``options.trace_dir`` is set (one file per process and job)."""
    if options.trace_dir is not None and options.job.tracer is None:
        options.job.tracer = OpTracer.for_group(options.trace_dir, group)
    return options.job.tracer


def run_step(options: DualPipeOptions, step_plan: StepPlan, forward_step_func: Callable, data_iterator: Any,
             first_val_step: bool | None) -> MegatronStep:
    """Execute this rank's op list through Megatron's handlers; each reads its micro-batch's data by the op's key."""
    sp, config = step_plan, step_plan.config
    if config.param_sync_func is not None:
        for c, func in enumerate(_as_list(config.param_sync_func, len(sp.chunks))):
            func(sp.chunks[c].parameters())
    num_microbatches = sp.sched.microbatches
    per_direction = sp.sched.microbatches_per_direction
    data = [MicrobatchData(it, num_microbatches) for it in _as_list(data_iterator, len(sp.chunks))]
    device = next(sp.chunks[0].parameters()).device
    step = MegatronStep(forward_step_func, sp.chunks, data, config, num_microbatches,
                        sp.pg_collection.cp.size(), sp.forward_only, first_val_step,
                        num_tokens=torch.zeros((), dtype=torch.int, device=device))
    handlers_cls = MoEOverlapHandlers if sp.overlap else MegatronHandlers
    handlers = handlers_cls(step, sp.sched.stages_on(sp.rank), sp.sched.stages - 1, per_direction)
    p2p = P2P(DistTransport(sp.group, list(range(sp.sched.ranks))), sp.rank, device, lambda edge: sp.shapes,
              config.pipeline_dtype, options.timeout, options.debug_p2p)
    executor = Executor(sp.sched, sp.rank, handlers, p2p, defer_weight_grads=options.defer_weight_grads,
                        use_overlap_hook=sp.overlap, observer=_tracer(options, sp.group))
    recording = (contextlib.nullcontext() if sp.forward_only
                 else recording_mtp_metrics(config, lambda: step.microbatch))
    with stage_map_active(sp.stage_map), _no_sync(config, len(sp.chunks)), recording as mtp_records:
        with torch.no_grad() if sp.forward_only else contextlib.nullcontext():
            executor.run(sp.plan, sp.forward_only)
    step.mtp_records = mtp_records
    options.job.last_stats = executor.stats
    if sp.overlap:
        announce_overlap(executor.stats.overlapped, executor.stats.deferred, sp.sched.ops[sp.rank],
                         sp.overlap_layers)
    elif options.defer_weight_grads and not sp.forward_only and not options.job.w_split_announced:
        options.job.w_split_announced = True
        if dist.get_rank() == 0:
            print(f"DualPipe W split: the first training step's W ops on this rank ran {executor.stats.deferred} "
                  f"deferred weight-grad closures", flush=True)
    step.finish()
    return step


CHECK_EXPERT_BIAS_ENV = "DUALPIPE_CHECK_EXPERT_BIAS"  # "1": after every step, compare the copies' biases


def check_mirrored_expert_bias(sp: StepPlan, mirror_group: dist.ProcessGroup | None) -> None:
    """Debug check (collective over the world): every router's ``expert_bias`` is bitwise equal in
    both DualPipe copies after the step's update; raises on every rank otherwise."""
    checked, differ = (0, 0) if mirror_group is None else mirrored_expert_bias_mismatches(
        sp.chunks, sp.stage_map, sp.rank, mirror_group)
    totals = torch.tensor([checked, differ], dtype=torch.int64, device=next(sp.chunks[0].parameters()).device)
    dist.all_reduce(totals)
    checked, differ = (int(v) for v in totals)
    if differ:
        raise RuntimeError(f"DualPipe expert-bias check: {differ} of {checked} router copies differ "
                           "from their mirrored copy after the bias update")
    if dist.get_rank() == 0:
        print(f"DualPipe expert-bias check: all {checked} router copies equal their mirrored copies "
              "bitwise", flush=True)


def finish_step(options: DualPipeOptions, step_plan: StepPlan, step: MegatronStep,
                force_all_reduce: bool | None) -> list:
    """Sum tied and mirrored grads, let Megatron finalize, replay the MTP metrics on every pipeline
    rank, and relay the loss reports to the last one, where Megatron's training log reads them."""
    sp, config = step_plan, step_plan.config
    if not sp.forward_only:
        options.job.run_step_end(sp.chunks)  # before any cross-rank sum (job.py)
        sum_tied_embedding_grads(sp.chunks, sp.stage_map, sp.rank)
        if sp.sched.directions > 1:
            sum_mirrored_grads(sp.chunks, sp.stage_map, sp.rank, options.job.mirror_group)
            sum_mirrored_expert_token_counts(sp.chunks, sp.stage_map, sp.rank, options.job.mirror_group)
        if config.grad_sync_func is not None:
            for c, func in enumerate(_as_list(config.grad_sync_func, len(sp.chunks))):
                func(sp.chunks[c].parameters())
        if config.finalize_model_grads_func is not None:
            total = None
            if config.calculate_per_token_loss:
                # Only ranks holding a last stage counted tokens; every rank needs the total.
                total = step.num_tokens.clone()
                dist.all_reduce(total, group=sp.group)
            config.finalize_model_grads_func(
                sp.chunks, total,
                pg_collection=sp.pg_collection, force_all_reduce=force_all_reduce,
            )
        if sp.sched.directions > 1 and os.environ.get(CHECK_EXPERT_BIAS_ENV) == "1":
            check_mirrored_expert_bias(sp, options.job.mirror_group)
        if step.mtp_records is not None:
            replay_mtp_metrics(step.mtp_records, sp.group, step.num_tokens.device)  # made on the model's device
    return _relay_to_last_rank(sp.sched, sp.rank, step, sp.group, options.job.report_layouts)


def make_forward_backward_func(options: DualPipeOptions) -> Callable[..., list]:
    """A function with the keyword signature of Megatron's schedules, running ``options.schedule``."""
    if options.schedule not in SCHEDULES:
        raise ValueError(f"unknown DualPipe schedule {options.schedule!r}; choose from {SCHEDULES}")
    check_private_symbols()  # Megatron functions we call positionally or that are private

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
        step_plan = plan_step(
            options, forward_step_func=forward_step_func, model=model, num_microbatches=num_microbatches,
            seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
            forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
            adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, pg_collection=pg_collection,
        )
        timers = step_plan.config.timers
        if timers is not None:
            timers("forward-backward", log_level=1).start(barrier=step_plan.config.barrier_with_L1_time)
        step = run_step(options, step_plan, forward_step_func, data_iterator, first_val_step)
        reports = finish_step(options, step_plan, step, force_all_reduce)
        if timers is not None:
            timers("forward-backward").stop()
        return reports

    return forward_backward_dualpipe


__all__ = [
    "DualPipeJob", "DualPipeOptions", "StepPlan", "check_activation_budget", "file_order", "finish_step",
    "make_forward_backward_func", "order_costs", "plan_for_step", "plan_step", "run_step", "stage_map_for", "training_order",
]
