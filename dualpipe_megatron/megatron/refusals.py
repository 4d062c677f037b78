"""The one place that says whether a Megatron configuration can run under our schedules.

Every check the adapter makes lives here, grouped by when its inputs are known:
command-line arguments (:func:`argument_problems`, before Megatron's own checks,
which assume looped placement), the pipeline shape (:func:`configuration_problems`,
whose schedule rules come from the generators themselves), a step's call
(:func:`step_problems`), whether an MoE model can overlap F&B pairs
(:func:`overlap_blockers`) and Megatron's delayed weight gradients
(:func:`delayed_wgrad_problems`). Each returns the reasons, empty when supported.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any, Callable, Sequence

from torch import nn

from ..schedules import Schedule, ScheduleError, build_schedule
from .hybrid import layer_pattern, stage_layout
from .topology import StageMap, stage_layer_types

# Our schedules, registered once: the flag's choices, the options and the checks all read this.
SCHEDULES = ("dualpipev", "dualpipe")
MEGATRON_SCHEDULES = ("1f1b", "interleaved")


def stage_map_for(schedule: str, ranks: int) -> StageMap:
    """Placement of model stages on (rank, chunk); independent of the micro-batch count."""
    return StageMap.of(build_schedule(schedule, ranks, 2 * ranks))


def configuration_problems(schedule: str, pipeline_size: int, num_microbatches: int | None,
                           num_layers: int, layout: str | list | None = None, mtp_layers: int = 0) -> list[str]:
    """Why ``schedule`` cannot run this pipeline (the generators' own rules, then the layout)."""
    problems = schedule_problems(schedule, pipeline_size, num_microbatches)
    if problems:
        return problems
    try:
        stage_layer_types(num_layers, stage_map_for(schedule, pipeline_size).num_stages, layout, mtp_layers)
    except ScheduleError as exc:
        return [f"--pipeline-schedule {schedule}: {exc}"]
    return []


def schedule_problems(schedule: str, pipeline_size: int, num_microbatches: int | None) -> list[str]:
    """Why ``schedule`` cannot run ``pipeline_size`` ranks and this many micro-batches (the
    generators' own rules)."""
    if schedule not in SCHEDULES:
        return [f"unknown pipeline schedule {schedule!r}; choose from {', '.join(SCHEDULES)}"]
    if pipeline_size < 2:
        return [f"--pipeline-schedule {schedule} needs pipeline-model-parallel size >= 2"]
    microbatches = num_microbatches if num_microbatches is not None else 2 * pipeline_size
    try:
        build_schedule(schedule, pipeline_size, microbatches)
    except ScheduleError as exc:
        shape = f"pipeline-model-parallel size {pipeline_size}" + (
            f", {num_microbatches} micro-batches per step" if num_microbatches is not None else "")
        hint = ("; raise --global-batch-size or lower --micro-batch-size"
                if num_microbatches is not None and num_microbatches < 2 * pipeline_size else "")
        return [f"--pipeline-schedule {schedule} ({shape}): {exc}{hint}"]
    return []


def _have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def argument_problems(args: Any) -> list[str]:
    """Why Megatron's parsed ``args`` cannot run under ``args.pipeline_schedule`` (one of ours)."""
    schedule = args.pipeline_schedule
    problems = []
    for name in ("pipeline_model_parallel_layout", "num_layers_per_virtual_pipeline_stage",
                 "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers"):
        if getattr(args, name, None) is not None:
            problems.append(f"--pipeline-schedule {schedule} places stages itself; drop "
                            f"--{name.replace('_', '-')} (use --dualpipe-layout for uneven layers per stage)")
    for name, why in (("use_megatron_fsdp", "FSDP with our chunks is untested"),
                      ("use_torch_fsdp2", "FSDP with our chunks is untested")):
        if getattr(args, name, None):
            problems.append(f"--pipeline-schedule {schedule} does not support --{name.replace('_', '-')}: {why}")
    if getattr(args, "overlap_moe_expert_parallel_comm", False) and not getattr(args, "dualpipe_moe_overlap", True):
        problems.append("--overlap-moe-expert-parallel-comm asks for the EP all-to-all overlap, which "
                        "--no-dualpipe-moe-overlap turns off; drop one of them")
    if (getattr(args, "fp8", None) or getattr(args, "fp4", None)) and not _have_transformer_engine():
        problems.append(f"--pipeline-schedule {schedule} with FP8/FP4 needs Transformer Engine, which is not "
                        f"installed: Megatron runs low-precision GEMMs only through TE layers "
                        f"(--transformer-impl transformer_engine)")
    if getattr(args, "cuda_graph_impl", "none") == "full_iteration":
        problems.append(f"--pipeline-schedule {schedule} does not support full-iteration CUDA graphs")
    if layer_pattern(args) is not None and getattr(args, "dualpipe_layout", None) is not None:
        problems.append("--dualpipe-layout does not apply to a HybridModel: its --hybrid-layer-pattern places "
                        "the layers (one '|' segment per model stage, in model order)")
    shape = schedule_problems(schedule, args.pipeline_model_parallel_size, None)
    if shape:
        return problems + shape
    try:
        layers = job_layers(args)
    except ScheduleError as exc:
        return problems + [f"--pipeline-schedule {schedule}: {exc}"]
    return problems + configuration_problems(schedule, args.pipeline_model_parallel_size, None, *layers)


def job_layers(args: Any) -> tuple[int, str | list | None, int]:
    """(decoder layers, layer layout, MTP layers) of a job under one of our schedules: a HybridModel's
    from its pattern (:mod:`.hybrid`), a GPTModel's from --num-layers, --dualpipe-layout and
    --mtp-num-layers. Raises ScheduleError for a pattern that does not fit the schedule's stages."""
    pattern = layer_pattern(args)
    if pattern is None:
        return args.num_layers, getattr(args, "dualpipe_layout", None), getattr(args, "mtp_num_layers", None) or 0
    return stage_layout(pattern, stage_map_for(args.pipeline_schedule, args.pipeline_model_parallel_size).num_stages)


def step_problems(config: Any, collect_non_loss_data: bool, adjust_tensor_shapes_fn: Callable | None) -> list[str]:
    """Megatron options of one ``forward_backward_func`` call our schedules do not run yet."""
    reasons = []
    if config.variable_seq_lengths:
        reasons.append("variable_seq_lengths (p2p shapes must be fixed)")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        reasons.append("defer_embedding_wgrad_compute")
    if collect_non_loss_data:
        reasons.append("collect_non_loss_data")
    if adjust_tensor_shapes_fn is not None:
        reasons.append("adjust_tensor_shapes_fn")
    return reasons


# What a model built outside our building hooks lacks, said at its first step.
UNBUILT = ("under our schedules each rank's two model chunks are the stage map's chunks (the "
           "embedding and the loss where the schedule puts them, not where rank order would), "
           "prepared once: build them through megatron.training's get_model (a model_provider) or "
           "pretrain with a config container (megatron.training.models.dist_utils."
           "build_virtual_pipeline_stages), with --pipeline-schedule enabled before Megatron parses "
           "its arguments (python -m dualpipe_megatron.launch, or dualpipe_megatron.routes."
           "install_for_training()); a model built by hand takes pre_process/post_process from "
           "dualpipe_megatron.megatron.model.chunk_roles and is passed to prepare_model()")


def chunk_role_problems(chunks: Sequence[nn.Module], stage_map: StageMap, rank: int) -> list[str]:
    """Chunks whose ``pre_process``/``post_process`` differ from the stage map's (a model built
    for looped placement), each named with what was expected."""
    from megatron.core.utils import get_attr_wrapped_model

    problems = []
    for c, chunk in enumerate(chunks):
        expected = (stage_map.is_first(rank, c), stage_map.is_last(rank, c))
        found = tuple(bool(get_attr_wrapped_model(chunk, flag, allow_none=True))
                      for flag in ("pre_process", "post_process"))
        if found != expected:
            problems.append(f"chunk {c} of pipeline rank {rank} (model stage {stage_map.stage(rank, c)}) has "
                            f"pre_process={found[0]}, post_process={found[1]}; expected "
                            f"pre_process={expected[0]}, post_process={expected[1]}")
    return problems


def _accepts_schedule_plan(func: Callable) -> bool:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    return "return_schedule_plan" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def overlap_blockers(config: Any, chunks: Sequence[nn.Module], forward_step_func: Callable) -> list[str]:
    """Why the MoE F&B overlap cannot run for this model (empty: it can)."""
    from megatron.core.utils import get_attr_wrapped_model, unwrap_model

    reasons = []
    if not getattr(config, "num_moe_experts", None):
        reasons.append("dense model (no MoE layers)")
    if (getattr(config, "expert_model_parallel_size", 1) or 1) <= 1:
        reasons.append("expert-model-parallel size 1 (no all-to-all to hide)")
    if getattr(config, "moe_token_dispatcher_type", None) not in ("alltoall", "flex"):
        reasons.append(f"token dispatcher {getattr(config, 'moe_token_dispatcher_type', None)!r} "
                       f"(needs alltoall or flex)")
    if getattr(config, "recompute_granularity", None) == "full" or getattr(config, "recompute_method", None):
        reasons.append("full activation recomputation")
    if "moe" in (getattr(config, "recompute_modules", None) or []):
        reasons.append("recompute of the moe module")
    if getattr(config, "moe_shared_expert_overlap", False):
        # Megatron's own overlap refuses it too (overlap_moe_expert_parallel_comm asserts): the plans
        # already run the shared expert in the attention node, beside the paired micro-batch's
        # all-to-all, so a second stream for it has nothing left to hide.
        reasons.append("--moe-shared-expert-overlap (Megatron's schedule plans refuse it; in the F&B overlap "
                       "the shared expert already runs beside the paired micro-batch's all-to-all: drop the flag)")
    if getattr(config, "num_moe_experts", None) and getattr(config, "moe_layer_freq", 1) != 1:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_moe_layer_pattern

        # From the config, not the chunks: every pipeline rank must decide alike.
        if not get_moe_layer_pattern(config)[-1]:
            reasons.append(f"dense last layer {config.num_layers} (Megatron's schedule plans apply the final "
                           f"layernorm only in an MoE layer's combine node, so they would skip it)")
    for chunk in chunks:
        try:
            get_attr_wrapped_model(chunk, "build_schedule_plan", return_model_obj=True)
        except RuntimeError:
            model = unwrap_model(chunk)
            reasons.append(f"{type(model).__name__} has no build_schedule_plan" + (
                " (Megatron-Core's schedule plans split GPTModel layers only)"
                if type(model).__name__ == "HybridModel" else ""))
            break
    if not reasons and not _accepts_schedule_plan(forward_step_func):
        reasons.append("forward_step_func does not accept return_schedule_plan=True "
                       "(return model.build_schedule_plan(...) then, as Megatron's pretrain_gpt does)")
    return reasons


def delayed_wgrad_problems(config: Any, sched: Schedule, rank: int, overlap: bool, deferring: bool,
                           forward_only: bool) -> list[str]:
    """Why this step cannot run with ``config.delay_wgrad_compute`` (empty: it can, or it is off)."""
    from .wgrad_te import fifo_order_violations

    if not getattr(config, "delay_wgrad_compute", False) or forward_only:
        return []
    if not overlap:
        return ["delay_wgrad_compute needs the MoE F&B overlap (every backward through Megatron's "
                "schedule plans, which call backward_dw); it is off for this model or by "
                "--no-dualpipe-moe-overlap"]
    return fifo_order_violations(sched, rank)[:3] if deferring else []


__all__ = [
    "MEGATRON_SCHEDULES", "SCHEDULES", "UNBUILT", "argument_problems", "chunk_role_problems",
    "configuration_problems", "delayed_wgrad_problems", "overlap_blockers", "stage_map_for", "step_problems",
]
