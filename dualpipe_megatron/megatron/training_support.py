"""``--pipeline-schedule`` for ``megatron.training``: the flag, its validation and the hooks.

:func:`install` patches, once and guarded, only these call-time lookups:

- ``arguments.add_megatron_arguments``: adds the flag and our options;
- ``arguments.validate_args``: checks the schedule first, hides our layout from Megatron's
  interleaved checks (which assume looped placement), then sets virtual pipeline size 2 and
  our :class:`DualPipeLayout` so every layer keeps its global number;
- ``parallel_state.initialize_model_parallel``: a first-rank-only embedding group (our ties
  are local to one rank);
- ``training.get_model``: builds each chunk with its true ``pre_process``/``post_process``,
  then :func:`prepare_model` (tie, mirror copies) before the optimizer exists;
- ``training.get_forward_backward_func``: returns our schedule;
- ``checkpointing.check_checkpoint_args``: refuses an optimizer state saved under another
  schedule in a layout that cannot move (the distributed optimizer's default format).

With ``--pipeline-schedule`` unset (or ``1f1b``/``interleaved``) Megatron behaves as it does
without us.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any, Callable

import torch.distributed as dist

from .guard import check_version, patch_attr
from .model import check_configuration, chunk_roles, dualpipe_layout, embedding_ranks, prepare_model
from .predicates import install_predicates, stage_map_active
from .schedule import SCHEDULES, DualPipeOptions, make_forward_backward_func, stage_map_for

CHOICES = ("1f1b", "interleaved", "dualpipe", "dualpipev")

# The job's schedule options, set by validate_args (one training job per process).
_state: dict[str, Any] = {"options": None, "stage_map_context": None}


def active_options() -> DualPipeOptions | None:
    return _state["options"]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("dualpipe", "DualPipe / DualPipeV pipeline schedules")
    group.add_argument(
        "--pipeline-schedule", choices=CHOICES, default=None,
        help="Pipeline schedule. Default: Megatron's own choice (1F1B, or interleaved 1F1B when "
             "a virtual pipeline size is set). dualpipev: P ranks run 2P stages in a V (rank r "
             "holds stages r and 2P-1-r; embedding and loss on rank 0); dualpipe: two directions, "
             "every stage held twice (2x parameters). Both need >= 2P micro-batches per step; "
             "dualpipe needs even P and an even number of micro-batches.")
    group.add_argument(
        "--dualpipe-layout", default=None,
        help="Layers per stage for dualpipe/dualpipev as Megatron's layout string, in model "
             "stage order (2P stages for dualpipev, P for dualpipe), e.g. 'Et|tt|tt|tL'. "
             "Default: an even split of --num-layers.")
    group.add_argument(
        "--dualpipe-p2p-timeout", type=float, default=600.0,
        help="Seconds any pipeline send/receive may wait before the step fails with an error "
             "naming the rank, peer, op and micro-batch (default 600).")
    group.add_argument(
        "--dualpipe-debug-p2p", action="store_true",
        help="Send a header with every pipeline message and fail on a (kind, direction, stage, "
             "micro-batch) mismatch.")
    group.add_argument(
        "--dualpipe-no-wgrad-split", action="store_true",
        help="Run every backward in full: no weight-gradient deferral to the schedule's W ops "
             "(zero-bubble filling off; numerics unchanged).")
    group.add_argument(
        "--no-dualpipe-moe-overlap", dest="dualpipe_moe_overlap", action="store_false",
        help="MoE models with expert parallelism > 1 (alltoall/flex dispatcher) run each F&B op "
             "as one overlapped forward+backward through Megatron's schedule plans (the "
             "dispatch/combine all-to-alls of one micro-batch hidden behind the other's compute; "
             "the forward step must accept return_schedule_plan). This flag runs F then B.")
    group.add_argument(
        "--dualpipe-trace", default=None, metavar="DIR",
        help="Record every executed pipeline op (rank, op, direction, stage, micro-batch, start, "
             "end, p2p wait) into one file per process in DIR (use a fresh DIR per run); "
             "'python -m dualpipe_megatron.trace merge|analyze|draw DIR' turns them into a "
             "Chrome/Perfetto trace, the measured bubbles and a timeline figure.")
    return parser


def _have_transformer_engine() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _microbatches(args: argparse.Namespace) -> int | None:
    if args.global_batch_size is None or args.micro_batch_size is None:
        return None
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def pre_validate(args: argparse.Namespace) -> None:
    """Reject what our schedules cannot run before Megatron's checks, which assume looped placement."""
    schedule = args.pipeline_schedule
    if schedule in (None, "1f1b", "interleaved"):
        return
    for name in ("pipeline_model_parallel_layout", "num_layers_per_virtual_pipeline_stage",
                 "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers"):
        if getattr(args, name, None) is not None:
            raise ValueError(
                f"--pipeline-schedule {schedule} places stages itself; drop --{name.replace('_', '-')} "
                f"(use --dualpipe-layout for uneven layers per stage)")
    for name, why in (("mtp_num_layers", "MTP is not wired for V-shaped chunks yet"),
                      ("use_megatron_fsdp", "FSDP with our chunks is untested"),
                      ("use_torch_fsdp2", "FSDP with our chunks is untested")):
        if getattr(args, name, None):
            raise ValueError(f"--pipeline-schedule {schedule} does not support --{name.replace('_', '-')}: {why}")
    if getattr(args, "overlap_moe_expert_parallel_comm", False) and not getattr(args, "dualpipe_moe_overlap",
                                                                                   True):
        raise ValueError("--overlap-moe-expert-parallel-comm asks for the EP all-to-all overlap, which "
                         "--no-dualpipe-moe-overlap turns off; drop one of them")
    if (getattr(args, "fp8", None) or getattr(args, "fp4", None)) and not _have_transformer_engine():
        raise ValueError(
            f"--pipeline-schedule {schedule} with FP8/FP4 needs Transformer Engine, which is not "
            f"installed: Megatron runs low-precision GEMMs only through TE layers "
            f"(--transformer-impl transformer_engine)")
    if getattr(args, "cuda_graph_impl", "none") == "full_iteration":
        raise ValueError(f"--pipeline-schedule {schedule} does not support full-iteration CUDA graphs")
    check_configuration(schedule, args.pipeline_model_parallel_size, None, args.num_layers,
                        args.dualpipe_layout)


def post_validate(args: argparse.Namespace) -> None:
    schedule = args.pipeline_schedule
    if schedule == "1f1b" and args.virtual_pipeline_model_parallel_size is not None:
        raise ValueError("--pipeline-schedule 1f1b conflicts with a virtual pipeline size; "
                         "use --pipeline-schedule interleaved")
    if schedule == "interleaved" and args.virtual_pipeline_model_parallel_size is None:
        raise ValueError("--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage "
                         "or --num-virtual-stages-per-pipeline-rank")
    if schedule not in SCHEDULES:
        _state["options"] = None
        return
    pp = args.pipeline_model_parallel_size
    check_configuration(schedule, pp, _microbatches(args), args.num_layers, args.dualpipe_layout)
    args.virtual_pipeline_model_parallel_size = 2
    args.pipeline_model_parallel_layout = dualpipe_layout(schedule, pp, args.num_layers, args.dualpipe_layout)
    args.overlap_p2p_comm = False
    args.align_param_gather = False
    _state["options"] = DualPipeOptions(schedule=schedule, timeout=args.dualpipe_p2p_timeout,
                                        debug_p2p=args.dualpipe_debug_p2p,
                                        defer_weight_grads=not args.dualpipe_no_wgrad_split,
                                        moe_overlap=getattr(args, "dualpipe_moe_overlap", True),
                                        trace_dir=args.dualpipe_trace)


def _validate_args(original: Callable, args: argparse.Namespace, defaults: dict | None = None) -> Any:
    pre_validate(args)
    result = original(args, defaults or {})
    post_validate(args)
    return result


def _initialize_model_parallel(original: Callable, *args: Any, **kwargs: Any) -> Any:
    if _state["options"] is not None and kwargs.get("get_embedding_ranks") is None:
        kwargs["get_embedding_ranks"] = embedding_ranks
    return original(*args, **kwargs)


def activate_job_stage_map(options: DualPipeOptions, pipeline_size: int):
    """The job's stage map, made the stage predicates' answer for the rest of the job on first
    use (before the first chunk is built)."""
    stage_map = stage_map_for(options.schedule, pipeline_size)
    if _state["stage_map_context"] is None:
        _state["stage_map_context"] = stage_map_active(stage_map)
        _state["stage_map_context"].__enter__()
    return stage_map


def pipeline_position() -> tuple[int, int]:
    """(pipeline rank, pipeline size) of this process."""
    from megatron.core import parallel_state

    return (parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size())


def _get_model(original: Callable, model_provider_func: Callable, *args: Any, **kwargs: Any) -> Any:
    options = _state["options"]
    if options is None:
        return original(model_provider_func, *args, **kwargs)
    rank, pp = pipeline_position()
    roles = chunk_roles(activate_job_stage_map(options, pp), rank)

    @functools.wraps(model_provider_func)
    def provider(*, vp_stage: int, **p_kwargs: Any) -> Any:
        # get_model passes pre/post from rank topology; ours follow the stage map.
        role = roles[vp_stage]
        p_kwargs.update(pre_process=role.pre_process, post_process=role.post_process)
        return model_provider_func(vp_stage=vp_stage, **p_kwargs)

    model = original(provider, *args, **kwargs)
    prepare_model(model, options, rank, pp)
    return model


def _get_forward_backward_func(original: Callable, *args: Any, **kwargs: Any) -> Callable:
    options = _state["options"]
    return original(*args, **kwargs) if options is None else make_forward_backward_func(options)


def _check_checkpoint_args(original: Callable, checkpoint_args: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(checkpoint_args, *args, **kwargs)
    from megatron.training.global_vars import get_args

    check_checkpoint_schedule(get_args(), checkpoint_args)
    return result


def check_checkpoint_schedule(current: argparse.Namespace, checkpoint_args: Any) -> None:
    """Refuse an optimizer state whose layout depends on the schedule it was saved under."""
    saved = getattr(checkpoint_args, "pipeline_schedule", None) or _megatron_default(checkpoint_args)
    ours = current.pipeline_schedule or _megatron_default(current)
    if saved != ours and current.use_distributed_optimizer and not current.no_load_optim \
            and not getattr(current, "dist_ckpt_optim_fully_reshardable", False):
        raise RuntimeError(
            f"this checkpoint was saved under --pipeline-schedule {saved}, the run uses {ours}: the "
            f"distributed optimizer's default checkpoint format follows the gradient-buffer layout, "
            f"which differs between schedules, so it cannot be loaded safely. Resume with "
            f"--no-load-optim, or save with --dist-ckpt-optim-fully-reshardable.")


def _megatron_default(args: Any) -> str:
    return "interleaved" if getattr(args, "virtual_pipeline_model_parallel_size", None) else "1f1b"


def _bind(original: Callable, hook: Callable) -> Callable:
    @functools.wraps(original)
    def patched(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)
    return patched


def install() -> None:
    """Patch ``megatron.training`` for ``--pipeline-schedule`` (idempotent, version-checked)."""
    check_version()
    from megatron.core import parallel_state
    from megatron.training import arguments, checkpointing, training

    install_predicates()
    original_add = arguments.add_megatron_arguments
    patch_attr(arguments, "add_megatron_arguments",
               functools.wraps(original_add)(lambda parser: add_arguments(original_add(parser))),
               ["parser"])
    for owner, name, hook, params in (
        (arguments, "validate_args", _validate_args, ["args", "defaults"]),
        (parallel_state, "initialize_model_parallel", _initialize_model_parallel,
         ["tensor_model_parallel_size", "pipeline_model_parallel_size"]),
        (training, "get_model", _get_model, ["model_provider_func", "model_type"]),
        (training, "get_forward_backward_func", _get_forward_backward_func, []),
        (checkpointing, "check_checkpoint_args", _check_checkpoint_args, ["checkpoint_args"]),
    ):
        patch_attr(owner, name, _bind(getattr(owner, name), hook), params)


__all__ = ["CHOICES", "activate_job_stage_map", "active_options", "add_arguments",
           "check_checkpoint_schedule", "install", "pipeline_position", "post_validate",
           "pre_validate"]
