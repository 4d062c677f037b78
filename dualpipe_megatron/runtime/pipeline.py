"""The native API: one rank's stage modules plus a schedule, stepped over a process group.

Everything that can be wrong with a call (module count, micro-batch count,
missing inputs or criterion, undeclared p2p shapes) is checked here, before the
first message is posted, so a bad call fails on its own rank at once instead of
leaving the peers waiting.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..schedules.ir import Schedule
from ..schedules.registry import build_schedule
from ..schedules.validate import validate
from .executor import Executor, OpObserver, StepStats
from .handlers import ModuleHandlers, StepData
from .p2p import DistTransport, P2P, Shape
from .agreement import check_plan_agreement
from .plan import MessagePlan
from .wgrad import make_linears_deferrable

ShapeSpec = Sequence[Sequence[int]] | Mapping[tuple[int, int], Sequence[Sequence[int]]]


def resolve_ranks(
    group: dist.ProcessGroup, rank_mapping: Sequence[int] | None
) -> tuple[int, list[int]]:
    """This process's pipeline rank and, per pipeline rank, its rank in ``group``.

    ``rank_mapping[g]`` is the pipeline rank of group rank ``g`` (the reference's convention).
    """
    size = group.size()
    mapping = list(range(size)) if rank_mapping is None else list(rank_mapping)
    if sorted(mapping) != list(range(size)):
        raise ValueError(f"rank_mapping must be a permutation of 0..{size - 1}, got {mapping}")
    group_rank_of = [0] * size
    for group_rank, pp_rank in enumerate(mapping):
        group_rank_of[pp_rank] = group_rank
    return mapping[group.rank()], group_rank_of


def module_device(modules: Sequence[nn.Module]) -> torch.device:
    """Where the stages live: their first parameter or buffer, else the CPU."""
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            return tensor.device
    return torch.device("cpu")


def split_microbatches(
    tensors: Sequence[torch.Tensor | None], count: int, dim: int, what: str
) -> list[tuple[torch.Tensor | None, ...]]:
    """``count`` equal micro-batches along ``dim`` (``None`` entries stay ``None``)."""
    parts = []
    for i, t in enumerate(tensors):
        if t is None:
            parts.append([None] * count)
            continue
        if t.dim() <= dim or t.shape[dim] % count:
            raise ValueError(
                f"{what} {i} of shape {tuple(t.shape)} does not split into {count} equal "
                f"micro-batches along dim {dim}"
            )
        parts.append(t.tensor_split(count, dim=dim))
    return list(zip(*parts)) if parts else [() for _ in range(count)]


def gather_microbatches(micro: list[list[torch.Tensor]], dim: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
    joined = tuple(torch.cat(parts, dim=dim) for parts in zip(*micro))
    return joined[0] if len(joined) == 1 else joined


class Pipeline(nn.Module):
    """Pipeline-parallel training/inference steps for one rank, following a schedule IR.

    - ``modules``: this rank's stage modules in ``schedule.stages_on(rank)``
      order (DualPipeV rank ``r``: stages ``r`` then ``2P-1-r``; DualPipe:
      stage ``r`` of direction 0, then stage ``P-1-r`` of direction 1).
    - ``schedule``: a generator name (built per micro-batch count at
      :meth:`step`; ``chunks`` for ``interleaved``) or a :class:`Schedule`.
    - ``p2p_shapes``/``p2p_dtype``: per-micro-batch shapes of the tensors a
      stage sends, one list for every edge or a mapping from the sending stage
      ``(d, s)`` to its list; gradients travel with the same shapes.
    - ``rank_mapping[g]``: pipeline rank of group rank ``g`` (default identity).
    - ``timeout``: seconds any single p2p wait may take before
      :class:`PipelineCommError`; ``debug`` checks every message's identity.
    - ``defer_weight_grads=False`` runs every backward in full (W ops do
      nothing); ``defer_linear`` makes the stages' plain ``nn.Linear`` layers
      deferrable (see :mod:`.wgrad`); ``use_overlap_hook=False`` ignores
      ``overlapped_forward_backward``; ``recv_lookahead``: see :class:`Executor`.
    - ``observer``: told about every executed op with its times (e.g. a
      :class:`dualpipe_megatron.trace.OpTracer`); ``None`` costs nothing.

    After a step, :attr:`stats` holds its :class:`StepStats` counters.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        schedule: str | Schedule,
        *,
        process_group: dist.ProcessGroup | None = None,
        p2p_shapes: ShapeSpec | None = None,
        p2p_dtype: torch.dtype | None = None,
        batch_dim: int = 0,
        chunks: int | None = None,
        rank_mapping: Sequence[int] | None = None,
        timeout: float = 600.0,
        debug: bool = False,
        defer_weight_grads: bool = True,
        use_overlap_hook: bool = True,
        defer_linear: bool = True,
        recv_lookahead: int = 2,
        observer: OpObserver | None = None,
    ) -> None:
        super().__init__()
        self.module = nn.ModuleList(modules)
        self.group = process_group or dist.group.WORLD
        self.rank, self._group_rank_of = resolve_ranks(self.group, rank_mapping)
        self.schedule = schedule
        self.chunks = chunks
        self.p2p_shapes = p2p_shapes
        self.p2p_dtype = p2p_dtype
        self.batch_dim = batch_dim
        self.timeout = timeout
        self.debug = debug
        self.defer_weight_grads = defer_weight_grads
        self.use_overlap_hook = use_overlap_hook
        self.recv_lookahead = recv_lookahead
        self.observer = observer
        self.device = module_device(self.module)
        self.stats = StepStats()
        self._plans: dict[tuple[int, bool], tuple[Schedule, MessagePlan]] = {}
        self._agreed: set[tuple[int, bool]] = set()  # programs every rank proved it holds too
        if defer_linear:
            for module in self.module:
                make_linears_deferrable(module)

    # -- configuration checks ------------------------------------------------------
    def _schedule_for(self, microbatches: int | None) -> Schedule:
        if isinstance(self.schedule, Schedule):
            sched = self.schedule
            if microbatches not in (None, sched.microbatches):
                raise ValueError(
                    f"the schedule has {sched.microbatches} micro-batches, step() was asked for {microbatches}"
                )
            return sched
        if microbatches is None:
            raise ValueError(f"schedule {self.schedule!r} needs the number of micro-batches")
        return build_schedule(self.schedule, self.group.size(), microbatches, chunks=self.chunks)

    def _plan_for(self, microbatches: int | None, forward_only: bool) -> tuple[Schedule, MessagePlan]:
        cache_key = (microbatches, forward_only)
        if cache_key not in self._plans:
            sched = self._schedule_for(microbatches)
            if sched.ranks != self.group.size():
                raise ValueError(
                    f"schedule {sched.name!r} is for {sched.ranks} ranks, the process group has {self.group.size()}"
                )
            validate(sched)
            held = sched.stages_on(self.rank)
            if len(held) != len(self.module):
                raise ValueError(
                    f"pipeline rank {self.rank} holds {len(held)} stage(s) of {sched.name!r} "
                    f"({held}), but {len(self.module)} module(s) were given"
                )
            for end in (0, sched.stages - 1):
                here = [d for d in range(sched.directions) if sched.rank_of(d, end) == self.rank]
                if len(here) > 1:
                    raise ValueError(f"pipeline rank {self.rank} holds stage {end} of several directions {here}")
            self._plans[cache_key] = (sched, MessagePlan.build(sched, self.rank, forward_only))
        return self._plans[cache_key]

    def _shapes(self, edge: tuple[int, int]) -> list[Shape]:
        spec = self.p2p_shapes
        shapes = spec.get(edge) if isinstance(spec, Mapping) else spec
        if shapes is None:
            raise ValueError(f"no p2p shapes declared for the outputs of stage (d={edge[0]},s={edge[1]})")
        return [tuple(int(n) for n in shape) for shape in shapes]

    def _check_p2p(self, plan: MessagePlan) -> None:
        if self.p2p_shapes is None or self.p2p_dtype is None:
            raise ValueError("declare p2p_shapes and p2p_dtype before a step")
        for per_op in (*plan.recvs, *plan.sends):
            for items in per_op:
                for msg, _ in items:
                    self._shapes(msg.edge)

    def _step_data(
        self, sched: Schedule, inputs: Sequence[torch.Tensor | None], labels: Sequence[torch.Tensor | None],
        criterion: Callable | None, return_outputs: bool, forward_only: bool,
    ) -> StepData:
        count = sched.microbatches_per_direction
        data = StepData({}, {}, criterion, return_outputs)
        for d in range(sched.directions):
            if sched.rank_of(d, 0) == self.rank:
                if not any(t is not None for t in inputs):
                    raise ValueError(
                        f"pipeline rank {self.rank} holds the first stage of direction {d}: step() needs its inputs"
                    )
                data.inputs[d] = split_microbatches(inputs, count, self.batch_dim, "input")
            if sched.rank_of(d, sched.stages - 1) == self.rank:
                if criterion is None and not forward_only:
                    raise ValueError(
                        f"pipeline rank {self.rank} holds the last stage of direction {d}: "
                        "a training step needs a criterion"
                    )
                data.labels[d] = split_microbatches(labels, count, self.batch_dim, "label")
        return data

    # -- the step ------------------------------------------------------------------------
    def step(
        self,
        *inputs: torch.Tensor | None,
        num_microbatches: int | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        labels: Sequence[torch.Tensor | None] = (),
        return_outputs: bool = False,
    ) -> tuple[torch.Tensor | None, Any]:
        """One step; forward-only under ``torch.no_grad()``.

        ``inputs`` are needed where a direction's first stage is, ``labels`` and
        ``criterion`` (called as ``criterion(*outputs, *labels)`` per
        micro-batch; backward starts from each micro-batch loss, so define it
        such that micro-batch losses sum to the batch loss) where its last stage
        is. Returns ``(loss, outputs)`` there: the micro-batch losses stacked,
        and the outputs joined along ``batch_dim`` if ``return_outputs``;
        ``(None, None)`` elsewhere.
        """
        forward_only = not torch.is_grad_enabled()
        sched, plan = self._plan_for(num_microbatches, forward_only)
        self._check_p2p(plan)
        data = self._step_data(sched, inputs, labels, criterion, return_outputs, forward_only)
        if (num_microbatches, forward_only) not in self._agreed:  # after the local checks: bad calls stay local
            check_plan_agreement(sched, forward_only, self.group, self.device)
            self._agreed.add((num_microbatches, forward_only))
        handlers = ModuleHandlers(dict(zip(sched.stages_on(self.rank), self.module)), data, sched.stages - 1)
        p2p = P2P(
            DistTransport(self.group, self._group_rank_of), self.rank, self.device, self._shapes,
            self.p2p_dtype, self.timeout, self.debug,
        )
        executor = Executor(
            sched, self.rank, handlers, p2p, self.defer_weight_grads, self.use_overlap_hook, self.recv_lookahead,
            self.observer,
        )
        try:
            executor.run(plan, forward_only)
        finally:
            self.stats = executor.stats
        result = handlers.result
        ends = [d for d in range(sched.directions) if sched.rank_of(d, sched.stages - 1) == self.rank]
        if not ends:
            return None, None
        d = ends[0]
        count = sched.microbatches_per_direction
        loss = None
        if criterion is not None:
            loss = torch.stack([result.losses[d][m] for m in range(count)])
        outputs = None
        if return_outputs:
            outputs = gather_microbatches([result.outputs[d][m] for m in range(count)], self.batch_dim)
        return loss, outputs


__all__ = ["Pipeline", "ShapeSpec", "gather_microbatches", "module_device", "resolve_ranks", "split_microbatches"]
