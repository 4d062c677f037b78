"""EPLB in ``megatron.training``: the flags, the per-iteration statistics and the re-placement.

:func:`install` patches, once and guarded (its own :class:`PatchSet`), these call-time lookups:

- ``training.train_step``: the first call finds the MoE layers and hooks their routers (with
  ``--eplb-redundant-experts``, also gives each layer its compute slots and replicas and routes
  replica gradients into their owners' before any data-parallel reduction, :mod:`.replica_grads`); after
  every step, :class:`EplbController` copies owners' weights to replicas, sums the step's token
  counts over all ranks, logs them and, every ``--eplb-interval`` steps, re-places experts;
- ``training.save_checkpoint``: saves experts in logical order (placement undone around the
  save) and writes ``eplb.json`` (statistics and placement) into the checkpoint directory;
- ``training.load_checkpoint``: reads that file back, restored at the first step;
- ``MoEMetricsTracker.report``: reports ``eplb_max_mean_load`` with Megatron's MoE metrics.

It works the same under every pipeline schedule: nothing here depends on which one runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..megatron.guard import check_private_symbols, check_version
from ..megatron.hybrid import layer_pattern
from ..megatron.training_hooks import active_job, register_arguments
from ..patch_guard import PatchSet, around
from .experts import LayerKey, find_moe_layers, install_router_hook, take_counts, take_slot_counts
from .guard import adopt, imbalance, layer_imbalance, overall_imbalance
from .moves import move_experts
from .nodes import choose_policy, node_pattern
from .optimizer_state import PRIVATE_CALLS, OptimizerTensors
from .placement import align, as_plan, identity
from .planner import rebalance_experts
from .redundancy import choose_owners, initial_slots
from .replica_grads import forget_gradient_sources, hold_expert_buckets, wrap_gradient_path
from .replicas import LayerReplicas
from .stats import LoadStats

PATCHES = PatchSet("EPLB")
METRIC = "eplb_max_mean_load"
STATS_FILE_NAME = "eplb.json"
CHECK_REPLICAS_ENV = "DUALPIPE_EPLB_CHECK_REPLICAS"  # "1": before every step, compare replicas with owners
LOG_PLANS_ENV = "DUALPIPE_EPLB_LOG_PLANS"  # "1": log each re-plan's load and placements as JSON

_state: dict[str, Any] = {"controller": None, "loaded": None}


@dataclass(frozen=True)
class EplbOptions:
    interval: int
    window: int
    threshold: float
    stats_file: str | None
    redundant: int = 0
    gpus_per_node: int | None = None

    @property
    def collecting(self) -> bool:
        return self.interval > 0 or self.stats_file is not None or self.redundant > 0


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("eplb", "Expert-parallel load balancing (dualpipe_megatron.eplb)")
    group.add_argument(
        "--eplb-interval", type=int, default=0,
        help="Every N iterations, plan a placement of each MoE layer's experts over the EP ranks "
             "from the measured load (DeepSeek's EPLB algorithm) and, if adopted, move the experts' "
             "weights and optimizer state there; the model computes the same function. 0: off.")
    group.add_argument(
        "--eplb-window", type=int, default=10,
        help="Iterations of expert load the plan averages (moving window; default 10).")
    group.add_argument(
        "--eplb-threshold", type=float, default=0.02,
        help="Adopt a layer's new placement only if it lowers the predicted max/mean tokens per EP "
             "rank by at least this much (default 0.02).")
    group.add_argument(
        "--eplb-stats-file", default=None, metavar="FILE",
        help="Collect expert load (also without --eplb-interval) and write it to FILE as JSON every "
             "--log-interval iterations; 'python -m dualpipe_megatron.eplb stats|plan' reads it.")
    group.add_argument(
        "--eplb-redundant-experts", type=int, default=0, metavar="K",
        help="K extra expert slots per MoE layer over the EP group (a multiple of the EP size): hot "
             "experts get copies that share their tokens. Copies are replicas of the owner's weights "
             "outside the model (not in the optimizer or checkpoints); their gradients are added to the "
             "owner's before the data-parallel reduction and the updated weights copied back after each "
             "step. The planner places them every --eplb-interval iterations. 0: off.")
    group.add_argument(
        "--eplb-gpus-per-node", type=int, default=None, metavar="K",
        help="Ranks per node for node-limited placement: with --moe-router-num-groups G, the plan keeps "
             "each routing group's experts on one node (DeepSeek's hierarchical policy); rank r is on node "
             "r // K. Default: torchrun's LOCAL_WORLD_SIZE. Set it to simulate several nodes on one machine.")
    return parser


def options_from_args(args: argparse.Namespace) -> EplbOptions:
    return EplbOptions(args.eplb_interval, args.eplb_window, args.eplb_threshold, args.eplb_stats_file,
                       args.eplb_redundant_experts, args.eplb_gpus_per_node)


def argument_problems(args: argparse.Namespace) -> list[str]:
    """Everything EPLB cannot run with, as messages (empty: fine)."""
    options = options_from_args(args)
    problems = []
    if options.interval < 0:
        problems.append(f"--eplb-interval must be >= 0, got {options.interval}")
    if options.window < 1:
        problems.append(f"--eplb-window must be >= 1, got {options.window}")
    if options.threshold < 0:
        problems.append(f"--eplb-threshold must be >= 0, got {options.threshold}")
    if options.gpus_per_node is not None and options.gpus_per_node < 1:
        problems.append(f"--eplb-gpus-per-node must be >= 1, got {options.gpus_per_node}")
    if not options.collecting:
        return problems
    if options.redundant < 0:
        problems.append(f"--eplb-redundant-experts must be >= 0, got {options.redundant}")
    if not getattr(args, "num_experts", None):
        problems.append("--eplb-interval/--eplb-stats-file/--eplb-redundant-experts need an MoE model (--num-experts)")
        return problems
    if options.redundant > 0:
        problems += _redundancy_problems(args, options.redundant)
    if options.interval > 0:
        if args.expert_model_parallel_size < 2:
            problems.append("--eplb-interval needs --expert-model-parallel-size > 1 (there is nothing to re-place)")
        if getattr(args, "async_save", False):
            problems.append("--eplb-interval with --async-save is not supported (the save reads experts "
                            "after the placement is restored)")
        if args.use_distributed_optimizer and getattr(args, "overlap_param_gather", False):
            problems.append("--eplb-interval with --overlap-param-gather is not supported")
        if getattr(args, "moe_token_dispatcher_type", "alltoall") not in ("alltoall", "allgather"):
            problems.append("--eplb-interval supports the alltoall and allgather token dispatchers")
    return problems


def _redundancy_problems(args: argparse.Namespace, redundant: int) -> list[str]:
    """What redundant experts cannot run with (see docs/eplb.md, "Redundant experts")."""
    ep = args.expert_model_parallel_size
    problems = []
    if ep < 2:
        problems.append("--eplb-redundant-experts needs --expert-model-parallel-size > 1")
    elif redundant % ep:
        problems.append(f"--eplb-redundant-experts ({redundant}) must be a multiple of "
                        f"--expert-model-parallel-size ({ep})")
    if getattr(args, "moe_token_dispatcher_type", "alltoall") not in ("alltoall", "allgather"):
        problems.append("--eplb-redundant-experts supports the alltoall and allgather token dispatchers")
    if getattr(args, "moe_grouped_gemm", False):
        problems.append("--eplb-redundant-experts needs SequentialMLP experts: leave out --moe-grouped-gemm")
    if getattr(args, "moe_expert_capacity_factor", None) is not None:
        problems.append("--eplb-redundant-experts with --moe-expert-capacity-factor is not supported "
                        "(capacity would count slots, not experts)")
    if getattr(args, "fp8", None) or getattr(args, "fp4", None):
        problems.append("--eplb-redundant-experts does not support FP8/FP4 experts")
    if getattr(args, "moe_apply_probs_on_input", False):
        problems.append("--eplb-redundant-experts does not support --moe-apply-probs-on-input")
    return problems


# -- the controller --------------------------------------------------------------------------------


def _layer_number(key: LayerKey, num_layers: int) -> int:
    """Global 1-based MoE layer number: decoder layers, then MTP layers (Megatron's tracker order)."""
    kind, number = key
    return number if kind == "decoder" else num_layers + number


class EplbController:
    """EPLB for one training job on this rank: counts, statistics, placement and moves."""

    def __init__(self, options: EplbOptions, args: argparse.Namespace, model: list[torch.nn.Module],
                 optimizer: Any) -> None:
        self.options = options
        self.args = args
        self.handles = find_moe_layers(model)
        local_keys = sorted({h.key for h in self.handles})
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (local_keys, _node_pattern(options)))
        self.keys: list[LayerKey] = sorted({tuple(k) for keys, _ in gathered for k in keys},
                                           key=lambda k: _layer_number(k, args.num_layers))
        self.row = {k: i for i, k in enumerate(self.keys)}
        self.num_experts = args.num_experts
        self.ep_size = args.expert_model_parallel_size
        self.layer_numbers = [_layer_number(k, args.num_layers) for k in self.keys]
        self.stats = LoadStats(self.layer_numbers, self.num_experts, options.window)
        self.placement = identity(len(self.keys), self.num_experts)  # where the parameters are
        self.optimizer = optimizer
        self.states: OptimizerTensors | None = None  # built at the first move
        self.device = next(model[0].parameters()).device
        self.pending: str | None = None
        self.sync_seconds, self.sync_steps = 0.0, 0  # replica syncs since the last report
        for handle in self.handles:
            install_router_hook(handle)
        self.num_slots = self.num_experts + options.redundant
        groups = getattr(args, "moe_router_num_groups", None) or 1
        self.policy = choose_policy(self.num_experts, self.num_slots, groups, [pattern for _, pattern in gathered])
        if groups > 1 and (options.interval > 0 or options.redundant):
            _print_last(f"EPLB placement: {self.policy.reason}")
        self.slots: torch.Tensor | None = None  # compute slots, with redundant experts
        self.gradient_job = active_job()  # our schedules' job, where the replica-gradient action goes
        self.step_end_action = None  # that action (replica_grads.wrap_gradient_path)
        if options.redundant:
            first = initial_slots(self.num_experts, options.redundant, self.ep_size, self.policy.layout.nodes)
            self.slots = first.repeat(len(self.keys), 1)
            self.replicas = {id(h): LayerReplicas(h, self.num_slots) for h in self.handles}
            self._place_replicas()
            from megatron.core.utils import get_model_config

            self.step_end_action = wrap_gradient_path(get_model_config(model[0]), self.reduce_replica_grads,
                                                      self.gradient_job)
            hold_expert_buckets(model)
            self.reduced: set[int] = set()  # handles whose replica gradients went out this step
            self._report_memory()

    @property
    def compute_placement(self) -> torch.Tensor:
        """Which logical expert each compute slot runs (the parameters' placement without redundancy)."""
        return self.placement if self.slots is None else self.slots

    # -- redundant experts -----------------------------------------------------------------------
    def _place_replicas(self) -> None:
        for handle in self.handles:
            row = self.row[handle.key]
            self.replicas[id(handle)].place(self.slots[row], self.placement[row])

    def reduce_replica_grads(self, params: set[int] | None) -> None:
        """Replica gradients into their owners', once per step and layer: of the layers among
        ``params`` (parameter ids; None: all), right before Megatron reduces them over DP."""
        start = time.perf_counter()
        for handle in self.handles:
            if id(handle) in self.reduced or (params is not None and id(handle.slot_params[0][0]) not in params):
                continue
            self.replicas[id(handle)].reduce_grads()
            self.reduced.add(id(handle))
        self.sync_seconds += time.perf_counter() - start

    def check_replicas(self, iteration: int) -> None:
        """Compare every replica with its owner, bitwise; fail loudly on any difference."""
        bad = torch.tensor([sum(self.replicas[id(h)].mismatches() for h in self.handles)], device=self.device)
        copies = torch.tensor([sum(len(self.replicas[id(h)].buffers) for h in self.handles)], device=self.device)
        dist.all_reduce(bad)
        dist.all_reduce(copies)
        if int(bad):
            raise RuntimeError(f"EPLB: {int(bad)} replica tensors differ from their owners before iteration {iteration}")
        _print_last(f"EPLB replica check: all {int(copies)} replicas equal their owners bitwise (iteration {iteration})")

    def _report_memory(self) -> None:
        extra = torch.tensor([sum(self.replicas[id(h)].extra_bytes for h in self.handles)], device=self.device)
        dist.all_reduce(extra, op=dist.ReduceOp.MAX)
        _print_last(f"EPLB redundant experts: {self.options.redundant} extra slots per MoE layer "
                    f"({self.num_slots} compute slots for {self.num_experts} experts); replicas hold "
                    f"{int(extra) / 2**20:.2f} MiB on the busiest rank (weights + gradient buffers)")

    def _report_sync(self, iteration: int) -> None:
        spent = torch.tensor([self.sync_seconds], dtype=torch.float64, device=self.device)
        tokens = torch.tensor([sum(r.replica_tokens for r in self.replicas.values())], device=self.device)
        for r in self.replicas.values():
            r.replica_tokens = 0
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        dist.all_reduce(tokens)
        steps = max(1, self.sync_steps)
        _print_last(f"EPLB replica sync: {1e3 * float(spent) / steps:.2f} ms per step (gradients to owners + "
                    f"weights to replicas, busiest rank); replicas computed {int(tokens)} routed tokens "
                    f"(iterations up to {iteration})")
        self.sync_seconds, self.sync_steps = 0.0, 0

    # -- per step ------------------------------------------------------------------------------
    def _step_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's tokens per logical expert ``[layers, experts]`` and per compute slot
        ``[layers, slots]`` (the same without redundant experts), summed over every rank."""
        counts = torch.zeros(len(self.keys), self.num_experts + self.num_slots, dtype=torch.int64)
        for handle in self.handles:
            row = self.row[handle.key]
            counts[row, :self.num_experts] += take_counts(handle)
            if self.slots is not None:
                counts[row, self.num_experts:] += take_slot_counts(handle)
        counts = counts.to(self.device)
        dist.all_reduce(counts)
        duplicates = 1 if self.args.sequence_parallel else self.args.tensor_model_parallel_size
        counts = counts.cpu() // duplicates  # TP ranks without SP route the same tokens
        logical = counts[:, :self.num_experts]
        if self.slots is None:
            return logical, logical.gather(1, self.placement)
        return logical, counts[:, self.num_experts:]

    def before_step(self, iteration: int) -> None:
        if self.slots is not None and os.environ.get(CHECK_REPLICAS_ENV) == "1":
            self.check_replicas(iteration)

    def after_step(self, iteration: int) -> None:
        if self.slots is not None:
            self.reduced.clear()
            start = time.perf_counter()
            for handle in self.handles:  # the optimizer has just updated the owners
                self.replicas[id(handle)].sync_weights()
            self.sync_seconds += time.perf_counter() - start
            self.sync_steps += 1
            if iteration % self.args.log_interval == 0 or iteration == self.args.train_iters:
                self._report_sync(iteration)
        counts, per_slot = self._step_counts()
        self.stats.add(counts)
        per_rank = per_slot.double().view(len(self.keys), self.ep_size, -1).sum(dim=-1)
        self._record_metric(layer_imbalance(per_rank))
        if self.pending is not None:
            _print_last(f"{self.pending}, measured {overall_imbalance(per_rank):.3f} (iteration {iteration})")
            self.pending = None
        interval = self.options.interval
        if interval and iteration % interval == 0 and iteration < self.args.train_iters:
            self.replace(iteration)
        if self.options.stats_file and (iteration % self.args.log_interval == 0
                                        or iteration == self.args.train_iters):
            self.write_stats(self.options.stats_file, iteration)

    def replace(self, iteration: int) -> None:
        """Plan from the window's average load, keep what the guard rejects, move the rest."""
        load = self.stats.average()
        current = self.compute_placement
        new, aligned = current.clone(), current.clone()
        policy, layout = self.policy, self.policy.layout
        for row in range(len(self.keys)):
            phy2log = rebalance_experts(load[row:row + 1], self.num_slots, policy.groups, policy.num_nodes,
                                        self.ep_size)[0][0]
            aligned[row] = align(current[row], layout.in_ep_order(phy2log), self.ep_size, layout.nodes)
            if policy.hierarchical and not layout.keeps_groups(current[row], policy.groups, self.num_experts):
                new[row] = aligned[row]  # the guard may keep only a node-limited placement
                continue
            chosen = adopt(as_plan(current[row:row + 1], self.num_experts),
                           as_plan(aligned[row:row + 1], self.num_experts), load[row:row + 1],
                           self.options.threshold, num_gpus=self.ep_size)
            new[row] = chosen[0][0]
        if os.environ.get(LOG_PLANS_ENV) == "1":
            _print_last(f"EPLB plan at iteration {iteration}: " + json.dumps({
                "groups": policy.groups, "nodes": [list(n) for n in layout.nodes], "num_slots": self.num_slots,
                "load": load.tolist(), "aligned": aligned.tolist(), "placement": new.tolist()}))
        before = imbalance(as_plan(current, self.num_experts), load, self.ep_size)
        predicted = imbalance(as_plan(new, self.num_experts), load, self.ep_size)
        changed = (new != current)
        moved, layers = int(changed.sum()), int(changed.any(dim=1).sum())
        if self.slots is None:
            self.apply(new)
            what = "experts"
        else:
            owners_moved = self.place_slots(new)
            what = f"expert slots (parameters of {owners_moved} experts moved)"
        head = (f"EPLB iteration {iteration}: moved {moved} {what} in {layers} of {len(self.keys)} MoE layers; "
                f"max/mean tokens per EP rank (window of {len(self.stats.history)}): before {before:.3f}, "
                f"predicted {predicted:.3f}")
        if moved:
            self.pending = head
        else:
            _print_last(f"{head} (kept: gain below --eplb-threshold {self.options.threshold:g})")

    def apply(self, placement: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """Move this rank's expert parameters to ``placement`` and, with redundant experts, compute
        ``slots`` (replicas re-made and filled); collective over EP and expert-DP groups."""
        if self.states is None:
            self.states = OptimizerTensors(self.optimizer)
        for handle in self.handles:
            move_experts(handle, placement[self.row[handle.key]], self.states)
        self.placement = placement.clone()
        if slots is not None:
            self.slots = slots.clone()
            self._place_replicas()

    def place_slots(self, slots: torch.Tensor) -> int:
        """Compute ``slots`` with owners chosen for them from the current ones (:func:`choose_owners`);
        returns how many parameter slots changed expert."""
        owners = torch.stack([choose_owners(row, self.placement[r], self.ep_size) for r, row in enumerate(slots)])
        moved = int((owners != self.placement).sum())
        self.apply(owners, slots)
        return moved

    @property
    def placed(self) -> bool:
        return not torch.equal(self.placement, identity(len(self.keys), self.num_experts))

    def _record_metric(self, measured: torch.Tensor) -> None:
        """Per-layer max/mean tokens per EP rank into Megatron's MoE tracker (pipeline rank 0
        records; the tracker sums over the pipeline and averages over data parallel)."""
        from megatron.core import parallel_state
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        if parallel_state.get_pipeline_model_parallel_rank() != 0:
            return
        tracker = get_moe_metrics_tracker()
        numbers = self.layer_numbers
        pattern = layer_pattern(self.args)
        if pattern is not None:
            # Megatron's training log sizes a HybridModel's entries by the pattern's MoE count (MTP's
            # included) plus the MTP depths, and other pipeline ranks create ours at that size: one
            # slot per MoE layer, in layer order.
            from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, get_hybrid_layer_counts

            layers = get_hybrid_layer_counts(pattern)[Symbols.MOE]
            numbers = list(range(1, len(self.keys) + 1))
        else:
            layers = self.args.num_layers
        size = layers + (self.args.mtp_num_layers or 0)
        scale = get_num_microbatches()  # report() multiplies by 1 / micro-batches
        for number, value in zip(numbers, measured.tolist()):
            tracker.record(METRIC, torch.tensor(value * scale, device=self.device), number, size)

    # -- files -------------------------------------------------------------------------------
    def write_stats(self, path: str, iteration: int) -> None:
        if dist.get_rank() == dist.get_world_size() - 1 and not self.stats.empty:
            self.stats.save(path, iteration, self.compute_placement, self.ep_size)

    def restore(self, saved: dict[str, Any]) -> None:
        """Statistics and placement from a checkpoint's ``eplb.json`` (if they fit this model)."""
        if saved["layers"] != self.layer_numbers or saved["num_experts"] != self.num_experts:
            _print_last(f"EPLB: ignoring the checkpoint's statistics (layers {saved['layers']} x "
                        f"{saved['num_experts']} experts; this model {self.layer_numbers} x {self.num_experts})")
            return
        for counts in saved["history"][-self.options.window:]:
            self.stats.add(torch.tensor(counts, dtype=torch.float64))
        placement = saved.get("placement")
        restored = "Megatron's placement"
        fits = (placement is not None and saved.get("ep_size") == self.ep_size
                and len(placement[0]) == self.num_slots)
        if self.options.interval > 0 and fits:
            placement = torch.tensor(placement, dtype=torch.int64)
            if self.slots is None:
                self.apply(placement)
                restored = f"its placement ({int((self.placement != identity(*self.placement.shape)).sum())} experts moved)"
            else:
                changed = int((placement != self.slots).sum())
                self.place_slots(placement)
                restored = f"its placement ({changed} experts moved)"
        elif placement is not None and not fits:
            restored = (f"Megatron's placement (the checkpoint's has {len(placement[0])} slots per layer at "
                        f"EP {saved.get('ep_size')}; this job {self.num_slots} at EP {self.ep_size})")
        _print_last(f"EPLB: resumed with {len(self.stats.history)} iterations of the checkpoint's expert load "
                    f"and {restored}")


def _node_pattern(options: EplbOptions) -> tuple[int, ...]:
    """This rank's EP group as :func:`node_pattern` sees it (ranks per node: the flag, else torchrun's)."""
    from megatron.core import parallel_state

    per_node = options.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return node_pattern(dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group()), per_node)


def _print_last(message: str) -> None:
    from megatron.training.utils import print_rank_last

    print_rank_last(message)


# -- hooks -----------------------------------------------------------------------------------------


def _options() -> EplbOptions | None:
    from megatron.training.global_vars import get_args

    options = options_from_args(get_args())
    return options if options.collecting else None


def _train_step(original: Callable, forward_step_func: Any, data_iterator: Any, model: list, optimizer: Any,
                *args: Any, **kwargs: Any) -> Any:
    controller = _state["controller"]
    if controller is None and (options := _options()) is not None:
        from megatron.training.global_vars import get_args

        controller = _state["controller"] = EplbController(options, get_args(), model, optimizer)
        if _state["loaded"] is not None:
            controller.restore(_state["loaded"])
    if controller is not None:
        from megatron.training.global_vars import get_args

        controller.before_step(get_args().curr_iteration + 1)
    result = original(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
    if controller is not None:
        from megatron.training.global_vars import get_args

        controller.after_step(get_args().curr_iteration + 1)
    return result


def _save_checkpoint(original: Callable, iteration: int, *args: Any, **kwargs: Any) -> Any:
    controller: EplbController | None = _state["controller"]
    if controller is None:
        return original(iteration, *args, **kwargs)
    placement = controller.placement.clone()
    if controller.placed:
        controller.apply(identity(len(controller.keys), controller.num_experts))
    # A failed save propagates as it is: moving back would start collectives its peers may never join.
    result = original(iteration, *args, **kwargs)
    if not torch.equal(placement, controller.placement):
        controller.apply(placement)
    if not kwargs.get("non_persistent_ckpt") and dist.get_rank() == 0 and not controller.stats.empty:
        from megatron.training.checkpointing import get_checkpoint_name
        from megatron.training.global_vars import get_args

        directory = get_checkpoint_name(get_args().save, iteration, return_base_dir=True)
        controller.stats.save(os.path.join(directory, STATS_FILE_NAME), iteration, controller.compute_placement,
                              controller.ep_size)
    return result


def _load_checkpoint(original: Callable, *args: Any, **kwargs: Any) -> Any:
    result = original(*args, **kwargs)
    from megatron.training.checkpointing import get_checkpoint_name
    from megatron.training.global_vars import get_args

    megatron_args = get_args()
    iteration = result[0] if isinstance(result, tuple) else 0
    load_dir = getattr(megatron_args, kwargs.get("load_arg", "load"), None)
    if iteration and load_dir and options_from_args(megatron_args).collecting:
        path = os.path.join(get_checkpoint_name(load_dir, iteration, return_base_dir=True), STATS_FILE_NAME)
        if os.path.exists(path):
            _state["loaded"] = json.loads(open(path).read())
    return result


def _report(original: Callable, self: Any, *args: Any, track_names: Any = None, **kwargs: Any) -> Any:
    if track_names is not None and _state["controller"] is not None:
        names = [track_names] if isinstance(track_names, str) else list(track_names)
        track_names = names + [METRIC]
    return original(self, *args, track_names=track_names, **kwargs)


def validate(args: argparse.Namespace) -> None:
    problems = argument_problems(args)
    if problems:
        raise ValueError("; ".join(problems))


def install() -> None:
    """Register the ``--eplb-*`` flags with the schedule's argument hooks (idempotent,
    version-checked). ``megatron.training`` is patched only once validated arguments set one
    (:func:`_validate_and_patch`), so a job without EPLB runs Megatron's own functions."""
    check_version()
    check_private_symbols(PRIVATE_CALLS)
    register_arguments(add_arguments, _validate_and_patch)


def _validate_and_patch(args: argparse.Namespace) -> None:
    validate(args)
    if options_from_args(args).collecting:
        install_patches()


def install_patches() -> None:
    """Patch ``megatron.training`` for EPLB (idempotent): the step, checkpoint save and load, and
    the MoE metrics report."""
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker
    from megatron.training import training

    for owner, name, hook in (
        (training, "train_step", _train_step),
        (training, "save_checkpoint", _save_checkpoint),
        (training, "load_checkpoint", _load_checkpoint),
        (MoEMetricsTracker, "report", _report),
    ):
        if not PATCHES.is_patched(owner, name):
            PATCHES.patch(owner, name, around(getattr(owner, name), hook), SIGNATURES[name])


SIGNATURES = {
    "train_step": "(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, "
                  "forward_backward_func, iteration=None, pg_collection=None, p2p_communicator=None)",
    "save_checkpoint": "(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far, "
                       "checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None, "
                       "pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False, "
                       "train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False, "
                       "tp_group=None, pp_group=None, dp_cp_group=None, dp_group=None, expt_dp_group=None, "
                       "rng_state_key_prefix='')",
    "load_checkpoint": "(ddp_model, optimizer, opt_param_scheduler, load_arg='load', strict=True, "
                       "checkpointing_context=None, skip_load_to_model_and_opt=False, tp_group=None, "
                       "pp_group=None, dp_cp_group=None, dp_group=None, expt_dp_group=None, "
                       "rng_state_key_prefix='')",
    "report": "(self, loss_scale, iteration, writer=None, wandb_writer=None, per_layer_logging=False, "
              "force_initialize=False, track_names=None, num_layers=None, moe_layer_freq=None, "
              "mtp_num_layers=None, total_loss_dict=None, percentiles=None, pg_collection=None)",
}


def uninstall() -> None:
    PATCHES.restore()
    controller = _state["controller"]
    if controller is not None:
        forget_gradient_sources(controller.gradient_job, controller.step_end_action)
    _state.update(controller=None, loaded=None)


__all__ = ["METRIC", "PATCHES", "EplbController", "EplbOptions", "add_arguments", "argument_problems",
           "install", "options_from_args", "uninstall", "validate"]
