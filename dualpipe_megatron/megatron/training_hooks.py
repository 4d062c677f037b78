"""``--pipeline-schedule`` for ``megatron.training``: the flag, its validation and the hooks.

:func:`install` patches, once and guarded, these call-time lookups (docs/training.md's
"How it plugs into Megatron" lists them as the guard records them, generated and tested):

- ``arguments.add_megatron_arguments``: adds the flag and our options (and those of features
  registered with :func:`register_arguments`: EPLB's ``--eplb-*``, checked after validation);
- ``arguments.validate_args``: checks the schedule first, hides our layout from Megatron's
  interleaved checks (which assume looped placement), then sets virtual pipeline size 2 and
  our :class:`DualPipeLayout` so every layer keeps its global number;
- ``parallel_state.initialize_model_parallel``: a first-rank-only embedding group (our ties
  are local to one rank), also in place of a script's own ``get_embedding_ranks``;
- ``training.get_model`` (the legacy route: a script passes ``model_provider``): builds each
  chunk with its true ``pre_process``/``post_process``, then :func:`prepare_model` (tie, mirror
  copies) on the wrapped chunks, before the optimizer exists;
- ``models.dist_utils.build_virtual_pipeline_stages`` and ``models.build_virtual_pipeline_stages``
  (its re-export; the config-container route of Megatron-LM 0.19's ``pretrain_gpt.py``, the GPT
  and hybrid model builders): the same roles, then :func:`prepare_model` on the chunks before
  Megatron wraps them;
- ``training.get_forward_backward_func``: returns our schedule;
- ``checkpointing.check_checkpoint_args``: refuses an optimizer state saved under another
  schedule in a layout that cannot move (the distributed optimizer's default format);
- ``parallel_state.is_pipeline_first_stage`` and ``parallel_state.is_pipeline_last_stage``
  (through :func:`install_predicates`): answer for our stage placement while a stage map is
  active, and as Megatron's own otherwise;
- ``multi_token_prediction.is_vp_last_stage`` and ``module.Float16Module.forward`` (also through
  :func:`install_predicates`): while a stage map is active, the MTP block is built, and the fp32
  output cast applied, at the chunks holding the last model stage;
- ``hybrid_layer_allocation.select_pipeline_segment`` (also through :func:`install_predicates`):
  while a stage map is active, a HybridModel chunk builds the layers of its model stage
  (``--hybrid-layer-pattern``'s ``|`` segments in model order, see ``hybrid``).

Building the model under our schedules adds, through :func:`prepare_model` (run by either
building hook), the weight-gradient deferral patches of
``tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.forward``/``backward``
and ``TransformerLayerNode.backward_dw`` (inert outside a ``B`` with ``w:false``; see
``wgrad_megatron`` and ``wgrad_te``) and, for ``dualpipe``, replaces the direction-1 chunk's
own ``sharded_state_dict`` so its copy saves as a replica.

With ``--pipeline-schedule`` unset (or ``1f1b``/``interleaved``) Megatron behaves as it does
without us.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any, Callable


from ..schedules import ScheduleError, build_schedule
from ..schedules.cli import positive_int
from ..schedules.simulate import Costs, StageCosts
from ..patch_guard import PatchSet, around
from .auto_layout import auto_layout
from .guard import check_version
from .model import check_configuration, chunk_roles, dualpipe_layout, embedding_ranks, prepare_model
from .predicates import install_predicates, set_job_stage_map
from .job import DualPipeJob
from .schedule import DualPipeOptions, check_activation_budget, file_order, make_forward_backward_func
from .hybrid import layer_pattern, stage_segments
from .refusals import MEGATRON_SCHEDULES, SCHEDULES, argument_problems, job_layers, stage_map_for

CHOICES = MEGATRON_SCHEDULES + SCHEDULES

PATCHES = PatchSet("training flag support")
_INITIALIZE_MODEL_PARALLEL = (
    "(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, "
    "virtual_pipeline_model_parallel_size=None, pipeline_model_parallel_comm_backend=None, "
    "use_sharp=False, context_parallel_size=1, hierarchical_context_parallel_sizes=None, "
    "hybrid_context_parallel=False, expert_model_parallel_size=1, gtp_remat_size=1, "
    "expert_gtp_remat_size=1, num_distributed_optimizer_instances=1, "
    "expert_tensor_parallel_size=None, nccl_communicator_config_path=None, "
    "distributed_timeout_minutes=30, order='tp-cp-ep-dp-pp', get_embedding_ranks=None, "
    "get_position_embedding_ranks=None, create_gloo_process_groups=True, "
    "high_priority_stream_groups=None, sharp_enabled_group=None, rank_offset=0, "
    "local_world_size=None)"
)
_BUILD_VIRTUAL_PIPELINE_STAGES = (
    "(build_model_func, pg_collection, vp_size, model_type=<ModelType.encoder_or_decoder: 1>)"
)

# The job's schedule options, set by validate_args (one training job per process).
_state: dict[str, Any] = {"options": None}


def active_options() -> DualPipeOptions | None:
    return _state["options"]


def set_active_options(options: DualPipeOptions | None) -> None:
    """The job our hooks serve, for routes that configure it without Megatron's arguments
    (Megatron-Bridge's ``enable``); None: Megatron's own behaviour again."""
    _state["options"] = options


def active_job() -> DualPipeJob | None:
    """The job our schedules run (where other features register step-end actions); None when
    ``--pipeline-schedule`` is not one of ours."""
    options = _state["options"]
    return None if options is None else options.job


# Other features' flags (EPLB), parsed and checked through our argument hooks so that both the
# runtime patches and the upstream plugin route carry them: (add_arguments, validate) pairs.
_EXTRA_ARGUMENTS: list[tuple[Callable[[argparse.ArgumentParser], Any], Callable[[argparse.Namespace], None]]] = []


def register_arguments(add: Callable[[argparse.ArgumentParser], Any],
                       validate: Callable[[argparse.Namespace], None]) -> None:
    """Add a feature's flags to Megatron's parser and check them after Megatron's validation."""
    if (add, validate) not in _EXTRA_ARGUMENTS:
        _EXTRA_ARGUMENTS.append((add, validate))


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
             "stage order (2P stages for dualpipev, P for dualpipe), e.g. 'Et|tt|tt|tL', with "
             "--mtp-num-layers' MTP layers (m) just before the loss, e.g. 'Et|tt|tt|tmL'; or 'auto': "
             "the split with the shortest simulated step under a FLOP model of this model "
             "(embedding, dense/MoE layers, output layer and loss, MTP). "
             "Default: an even split of --num-layers, MTP layers with the loss.")
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
        "--dualpipe-optimize-order", action="store_true",
        help="Run an op order optimized for the stage costs (--dualpipe-stage-costs, default uniform "
             "F=1 B=2 W=1 F&B=3) instead of DeepSeek's: never a longer simulated step nor a higher "
             "per-rank activation peak; numerics unchanged (rank 0 logs the simulated gain).")
    group.add_argument(
        "--dualpipe-max-activations", type=positive_int, default=None, metavar="K",
        help="Activation budget: run the fastest op order found (for --dualpipe-stage-costs, default "
             "uniform; implies --dualpipe-optimize-order) in which no rank holds more than K live stage "
             "activations, each one (direction, stage, micro-batch) from its forward to its weight "
             "grad (docs/schedules.md, 'An activation budget'). Below DeepSeek's peak the step gets "
             "longer; K below the schedule's minimum (2 for dualpipev, 1 for dualpipe) is an error.")
    group.add_argument(
        "--dualpipe-stage-costs", default=None, metavar="FILE",
        help="Per-(direction, stage) costs for --dualpipe-optimize-order and --dualpipe-max-activations, "
             "as written by 'python -m dualpipe_megatron.trace costs' (docs/schedule_format.md).")
    group.add_argument(
        "--dualpipe-schedule-file", default=None, metavar="FILE",
        help="Run the op order in this schedule JSON, as 'dualpipe-schedules dump' writes it "
             "(e.g. with --optimize --max-activations K), instead of DeepSeek's: it must be made for "
             "this job's schedule, pipeline size and micro-batches per step, and every pipeline rank "
             "must load the same order (docs/schedules.md). Excludes --dualpipe-optimize-order, "
             "--dualpipe-max-activations and --dualpipe-stage-costs.")
    group.add_argument(
        "--dualpipe-trace", default=None, metavar="DIR",
        help="Record every executed pipeline op (rank, op, direction, stage, micro-batch, start, "
             "end, p2p wait) into one file per process in DIR (use a fresh DIR per run); "
             "'python -m dualpipe_megatron.trace merge|analyze|draw DIR' turns them into a "
             "Chrome/Perfetto trace, the measured bubbles and a timeline figure.")
    for add, _ in _EXTRA_ARGUMENTS:
        add(parser)
    return parser


def _microbatches(args: argparse.Namespace) -> int | None:
    if args.global_batch_size is None or args.micro_batch_size is None:
        return None
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def pre_validate(args: argparse.Namespace) -> None:
    """Reject what our schedules cannot run before Megatron's checks, which assume looped placement."""
    if args.pipeline_schedule not in SCHEDULES:
        return
    hybrid = layer_pattern(args) is not None
    if getattr(args, "dualpipe_layout", None) == "auto" and not hybrid:
        args.dualpipe_layout = auto_layout(args)
        if args.rank == 0:
            print(f"dualpipe: --dualpipe-layout auto chose {args.dualpipe_layout}", flush=True)
    problems = argument_problems(args)
    if problems:
        raise ValueError("; ".join(problems))
    if hybrid:
        if args.rank == 0:
            stages = stage_map_for(args.pipeline_schedule, args.pipeline_model_parallel_size).num_stages
            segments = stage_segments(layer_pattern(args), stages)
            print(f"dualpipe: HybridModel layers by model stage: {'|'.join(segments)}", flush=True)
    elif getattr(args, "dualpipe_layout", None) is not None:
        # Without a layout Megatron asks --num-layers to divide by P (DeepSeek-V3's 61 at P=16
        # do not); ours places layers by model stage. Megatron only counts a layout's stages
        # here: one per rank keeps its interleaved checks off. post_validate sets ours.
        args.pipeline_model_parallel_layout = "|".join(["t"] * args.pipeline_model_parallel_size)


def post_validate(args: argparse.Namespace) -> None:
    for _, validate in _EXTRA_ARGUMENTS:
        validate(args)
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
    layers = job_layers(args)
    check_configuration(schedule, pp, _microbatches(args), *layers)
    args.virtual_pipeline_model_parallel_size = 2
    args.pipeline_model_parallel_layout = dualpipe_layout(schedule, pp, *layers)
    args.overlap_p2p_comm = False
    args.align_param_gather = False
    _save_embedding_copies_plainly(args)
    schedule_file = _schedule_file(args, pp)
    _state["options"] = DualPipeOptions(schedule=schedule, timeout=args.dualpipe_p2p_timeout,
                                        debug_p2p=args.dualpipe_debug_p2p,
                                        defer_weight_grads=not args.dualpipe_no_wgrad_split,
                                        moe_overlap=getattr(args, "dualpipe_moe_overlap", True),
                                        trace_dir=args.dualpipe_trace,
                                        optimize_for=_optimization_costs(args, pp),
                                        max_activations=_activation_budget(args, pp),
                                        schedule_file=schedule_file)


def _optimization_costs(args: argparse.Namespace, pp: int) -> Costs | StageCosts | None:
    """The costs ``--dualpipe-optimize-order`` (or a budget, which implies it) optimizes for,
    checked against the job's schedule."""
    optimizing = args.dualpipe_optimize_order or args.dualpipe_max_activations is not None
    if args.dualpipe_stage_costs and not optimizing:
        raise ValueError("--dualpipe-stage-costs is used by --dualpipe-optimize-order and "
                         "--dualpipe-max-activations only; add one of them")
    if not optimizing:
        return None
    if not args.dualpipe_stage_costs:
        return Costs.of()
    try:
        costs = StageCosts.from_json_obj(json.loads(Path(args.dualpipe_stage_costs).read_text()))
        microbatches = _microbatches(args)
        if microbatches is not None:
            costs.check_covers(build_schedule(args.pipeline_schedule, pp, microbatches))
    except (OSError, json.JSONDecodeError, ScheduleError) as exc:
        raise ValueError(f"--dualpipe-stage-costs {args.dualpipe_stage_costs}: {exc}") from None
    return costs


def _activation_budget(args: argparse.Namespace, pp: int) -> int | None:
    """``--dualpipe-max-activations``, refused here when the micro-batch count is known and no
    order meets it (else at the first step, by the same check)."""
    budget = args.dualpipe_max_activations
    microbatches = _microbatches(args)
    if budget is not None and microbatches is not None:
        check_activation_budget(build_schedule(args.pipeline_schedule, pp, microbatches), budget)
    return budget


def _schedule_file(args: argparse.Namespace, pp: int) -> str | None:
    """``--dualpipe-schedule-file``, alone among the order flags, and checked against the job
    here when the micro-batch count is known (else at the first step, by the same check)."""
    path = getattr(args, "dualpipe_schedule_file", None)
    if path is None:
        return None
    searching = [flag for flag, value in (("--dualpipe-optimize-order", args.dualpipe_optimize_order),
                                          ("--dualpipe-max-activations", args.dualpipe_max_activations),
                                          ("--dualpipe-stage-costs", args.dualpipe_stage_costs)) if value]
    if searching:
        raise ValueError(f"--dualpipe-schedule-file runs the order in its file; drop {', '.join(searching)} "
                         "(optimize offline: dualpipe-schedules dump --optimize)")
    microbatches = _microbatches(args)
    if microbatches is not None:
        file_order(path, build_schedule(args.pipeline_schedule, pp, microbatches), announce=False)
    return path


def _save_embedding_copies_plainly(args: argparse.Namespace) -> None:
    """Our schedules hold the word embedding and its loss-stage copy (tied output layer, MTP) on
    one rank, both saved under the embedding's key. Megatron's fully parallel save spreads each
    shard's writing over the data-parallel ranks assuming one entry per rank, and then marks both
    entries as the writer: the save fails its own validation ("Invalid access pattern"). So with
    data parallel > 1 each shard is saved by its owner, as without that option."""
    copies = not args.untie_embeddings_and_output_weights or getattr(args, "mtp_num_layers", None)
    if copies and args.data_parallel_size > 1 and getattr(args, "ckpt_fully_parallel_save", False):
        args.ckpt_fully_parallel_save = False
        if args.rank == 0:
            print("dualpipe: --ckpt-fully-parallel-save turned off (the embedding and its loss-stage copy "
                  "share a rank; see Checkpoints in docs/training.md)", flush=True)


def _validate_args(original: Callable, args: argparse.Namespace, defaults: dict | None = None) -> Any:
    pre_validate(args)
    result = original(args, defaults or {})
    post_validate(args)
    return result


def _initialize_model_parallel(original: Callable, *args: Any, **kwargs: Any) -> Any:
    # Under our schedules the script's own get_embedding_ranks (Megatron-LM's pretrain_gpt.py
    # passes one) assumes looped placement: its [first, last] group is replaced too.
    kwargs["get_embedding_ranks"] = job_embedding_ranks(kwargs.get("get_embedding_ranks"))
    return original(*args, **kwargs)


def job_embedding_ranks(script_choice: Callable | None) -> Callable | None:
    """``get_embedding_ranks`` for this job: ours under dualpipe/dualpipev (ties are local to
    one rank), else the script's choice (None: Megatron's default)."""
    return script_choice if _state["options"] is None else embedding_ranks


def activate_job_stage_map(options: DualPipeOptions, pipeline_size: int):
    """The job's stage map, made the stage predicates' answer between steps too (model building,
    data loading, logging); each step also enters it around its own ops."""
    stage_map = stage_map_for(options.schedule, pipeline_size)
    set_job_stage_map(stage_map)
    return stage_map


def pipeline_position() -> tuple[int, int]:
    """(pipeline rank, pipeline size) of this process."""
    from megatron.core import parallel_state

    return (parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size())


def chunk_pre_post_process(vp_stage: int, pipeline_rank: int, pipeline_size: int) -> tuple[bool, bool]:
    """(pre_process, post_process) of chunk ``vp_stage`` under the active schedule's stage map,
    which becomes the predicates' answer from here on (model building, data loading)."""
    role = chunk_roles(activate_job_stage_map(_state["options"], pipeline_size), pipeline_rank)[vp_stage]
    return role.pre_process, role.post_process


def _with_chunk_roles(build_chunk: Callable, pipeline_rank: int, pipeline_size: int) -> Callable:
    """``build_chunk`` (a model provider or a builder's ``build_model``) called with our stage
    map's ``pre_process``/``post_process`` instead of the rank-topology ones it is passed."""
    @functools.wraps(build_chunk)
    def build(*args: Any, vp_stage: int, **kwargs: Any) -> Any:
        pre, post = chunk_pre_post_process(vp_stage, pipeline_rank, pipeline_size)
        return build_chunk(*args, **{**kwargs, "pre_process": pre, "post_process": post, "vp_stage": vp_stage})
    return build


def _get_model(original: Callable, model_provider_func: Callable, *args: Any, **kwargs: Any) -> Any:
    """The legacy route (a script passes ``model_provider``): chunks with our roles, prepared
    after Megatron wrapped them."""
    options = _state["options"]
    if options is None:
        return original(model_provider_func, *args, **kwargs)
    rank, pp = pipeline_position()
    model = original(_with_chunk_roles(model_provider_func, rank, pp), *args, **kwargs)
    prepare_model(model, options, rank, pp)
    return model


def _build_virtual_pipeline_stages(original: Callable, build_model_func: Callable, pg_collection: Any,
                                   vp_size: int | None, *args: Any, **kwargs: Any) -> Any:
    """The config-container route (Megatron-LM 0.19's pretrain_gpt.py, the GPT and hybrid
    builders): chunks with our roles, prepared before Megatron wraps them."""
    options = _state["options"]
    if options is None:
        return original(build_model_func, pg_collection, vp_size, *args, **kwargs)
    if vp_size != 2:
        raise ValueError(f"--pipeline-schedule {options.schedule}: the model config's virtual pipeline size "
                         f"is {vp_size}, expected 2 (set by our argument validation; build the config "
                         f"after parse_and_validate_args)")
    rank, pp = pg_collection.pp.rank(), pg_collection.pp.size()
    model = original(_with_chunk_roles(build_model_func, rank, pp), pg_collection, vp_size, *args, **kwargs)
    prepare_model(model, options, rank, pp)
    return model


def forward_backward_func_hook(original: Callable, *args: Any, **kwargs: Any) -> Callable:
    """Around a ``get_forward_backward_func`` binding: our schedule while a job of ours is active."""
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


def install() -> None:
    """Patch ``megatron.training`` for ``--pipeline-schedule`` (idempotent, version-checked)."""
    check_version()
    from megatron.core import parallel_state
    from megatron.training import arguments, checkpointing, training
    from megatron.training import models
    from megatron.training.models import dist_utils

    install_predicates()
    original_add = arguments.add_megatron_arguments
    PATCHES.patch(arguments, "add_megatron_arguments",
                  functools.wraps(original_add)(lambda parser: add_arguments(original_add(parser))),
                  "(parser)")
    for owner, name, hook, signature in (
        (arguments, "validate_args", _validate_args, "(args, defaults={})"),
        (parallel_state, "initialize_model_parallel", _initialize_model_parallel,
         _INITIALIZE_MODEL_PARALLEL),
        (training, "get_model", _get_model,
         "(model_provider_func, model_type=<ModelType.encoder_or_decoder: 1>, wrap_with_ddp=True, "
         "config=None, pg_collection=None)"),
        # The builders call it through dist_utils; the package re-exports it for other callers.
        (dist_utils, "build_virtual_pipeline_stages", _build_virtual_pipeline_stages,
         _BUILD_VIRTUAL_PIPELINE_STAGES),
        (models, "build_virtual_pipeline_stages", _build_virtual_pipeline_stages,
         _BUILD_VIRTUAL_PIPELINE_STAGES),
        (training, "get_forward_backward_func", forward_backward_func_hook,
         "(pp_size=None, vp_size=None, schedule_pg_collection=None)"),
        (checkpointing, "check_checkpoint_args", _check_checkpoint_args,
         "(checkpoint_args, skip_args=None)"),
    ):
        PATCHES.patch(owner, name, around(getattr(owner, name), hook), signature)


def uninstall() -> None:
    """Undo :func:`install`'s ``megatron.training`` patches (the stage predicates stay)."""
    PATCHES.restore()


__all__ = ["CHOICES", "PATCHES", "activate_job_stage_map", "active_job", "active_options", "add_arguments",
           "check_checkpoint_schedule", "chunk_pre_post_process", "forward_backward_func_hook", "install",
           "job_embedding_ranks", "pipeline_position", "post_validate", "pre_validate", "register_arguments",
           "set_active_options", "uninstall"]
