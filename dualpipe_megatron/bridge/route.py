"""``--pipeline-schedule dualpipev|dualpipe`` for Megatron-Bridge's ``pretrain()``.

Bridge builds its model, loads data and runs its training loop with Megatron-Core's names bound
into its own modules, so patching Megatron's module attributes (what the Megatron-LM routes
do) does not reach them. :func:`enable` sets the config for our placement, makes the
Megatron-side hooks live for this job (the job's options, the embedding group, the stage
predicates, the weight-gradient deferral) and patches, once and guarded, exactly these
Bridge bindings:

- ``training.train.get_forward_backward_func`` and ``training.eval.get_forward_backward_func``:
  our schedule for training and evaluation steps;
- ``models.model_provider._create_model``: the chunks are built with the roles of our stage map
  and prepared (local ties, mirror copies) before Bridge wraps them;
- ``is_pp_first_stage``/``is_pp_last_stage``/``is_vp_first_stage``/``is_vp_last_stage`` as bound in
  ``models.model_provider`` (each chunk's ``pre_process``/``post_process``) and ``training.gpt_step``
  (which chunks load tokens and labels), and ``is_pp_first_stage``/``is_pp_last_stage`` in
  ``training.utils.batch_utils``: while our stage map is active they answer for the model stages a
  rank or chunk holds, like the ``parallel_state`` predicates (:mod:`..megatron.predicates`).

The loss reaches the last pipeline rank, where Bridge's ``train_step`` and ``evaluate`` read it,
through the same relay as under Megatron-LM's loop.
"""

from __future__ import annotations

from typing import Any, Callable

from ..megatron import training_hooks
from ..megatron.model import check_configuration, dualpipe_layout, prepare_model
from ..megatron.predicates import active_stage_map
from ..megatron.schedule import DualPipeOptions
from ..megatron.refusals import schedule_problems
from ..patch_guard import PatchSet, around
from .version import check_bridge_version

PATCHES = PatchSet("Bridge route")
_GET_FORWARD_BACKWARD_FUNC = "(pp_size=None, vp_size=None, schedule_pg_collection=None)"
_CREATE_MODEL = "(model_provider, model_type, pg_collection)"


def enable(cfg: Any, schedule: str = "dualpipev", *, layout: str | None = None, **options: Any) -> DualPipeOptions:
    """Run ``pretrain(cfg, ...)`` under ``schedule``: call after building ``cfg`` (a recipe's
    ``ConfigContainer``), before ``pretrain``, in every process.

    ``layout`` is ``--dualpipe-layout``'s string (layers per model stage, e.g. ``'Et|tt|tt|tL'``);
    ``options`` are :class:`DualPipeOptions`' fields (``moe_overlap=False``, ``trace_dir=...``).
    Sets ``cfg.model``'s virtual pipeline size (2) and layer layout for our placement. Returns the
    job's options."""
    check_bridge_version()
    model = cfg.model
    problems = _config_problems(model, schedule)
    if problems:
        raise ValueError("; ".join(problems))
    pp = model.pipeline_model_parallel_size
    mtp_layers = getattr(model, "mtp_num_layers", None) or 0
    check_configuration(schedule, pp, None, model.num_layers, layout, mtp_layers)
    model.virtual_pipeline_model_parallel_size = 2
    model.pipeline_model_parallel_layout = dualpipe_layout(schedule, pp, model.num_layers, layout, mtp_layers)
    model.overlap_p2p_comm = False
    cfg.ddp.align_param_gather = False
    job = DualPipeOptions(schedule=schedule, **options)
    training_hooks.install()
    training_hooks.set_active_options(job)
    _install()
    return job


def _config_problems(model: Any, schedule: str) -> list[str]:
    """What in a Bridge model config our schedules cannot run (the flag route's checks, by field)."""
    problems = [f"{schedule}: drop cfg.model.{name}, our schedule places the stages (pass layout= for "
                f"uneven layers per stage)"
                for name in ("pipeline_model_parallel_layout", "virtual_pipeline_model_parallel_size",
                             "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
                if getattr(model, name, None) is not None]
    if getattr(model, "hybrid_layer_pattern", None) is not None:
        problems.append(f"{schedule}: Bridge's HybridModel providers are not hooked; use Megatron-LM's "
                        f"pretrain_hybrid.py (docs/training.md, 'HybridModel')")
    return problems + schedule_problems(schedule, model.pipeline_model_parallel_size, None)


def _create_model(original: Callable, model_provider: Any, model_type: Any, pg_collection: Any) -> Any:
    options = training_hooks.active_options()
    if options is None:
        return original(model_provider, model_type, pg_collection)
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    rank, pp = pg_collection.pp.rank(), pg_collection.pp.size()
    problems = schedule_problems(options.schedule, pp, get_num_microbatches())
    if problems:
        raise ValueError("; ".join(problems))
    training_hooks.activate_job_stage_map(options, pp)
    model = original(model_provider, model_type, pg_collection)
    prepare_model(model, options, rank, pp)
    return model


def _stage_aware(original: Callable, answer: Callable[..., bool]) -> Callable:
    """``original`` while no stage map is active, else ``answer`` (same arguments)."""
    def predicate(*args: Any, **kwargs: Any) -> bool:
        return (original if active_stage_map() is None else answer)(*args, **kwargs)
    return predicate


def _pp_predicates() -> dict[str, tuple[Callable[..., bool], str]]:
    """Our answers for the pg-based predicates, with the signatures they replace: a rank "is the
    first (last) stage" when one of its chunks holds it (or, while a chunk runs, that chunk does);
    a chunk when it holds it."""
    from megatron.core import parallel_state as ps

    return {
        "is_pp_first_stage": (lambda pp_group: ps.is_pipeline_first_stage(), "(pp_group)"),
        "is_pp_last_stage": (lambda pp_group: ps.is_pipeline_last_stage(), "(pp_group)"),
        "is_vp_first_stage": (lambda vp_stage, vp_size: ps.is_pipeline_first_stage(False, vp_stage),
                              "(vp_stage, vp_size)"),
        "is_vp_last_stage": (lambda vp_stage, vp_size: ps.is_pipeline_last_stage(False, vp_stage),
                             "(vp_stage, vp_size)"),
    }


def _install() -> None:
    """Patch Bridge's bindings (idempotent; each inert while no job of ours is active)."""
    from megatron.bridge.models import model_provider
    from megatron.bridge.training import eval as bridge_eval, gpt_step, train
    from megatron.bridge.training.utils import batch_utils

    for module in (train, bridge_eval):
        if not PATCHES.is_patched(module, "get_forward_backward_func"):
            PATCHES.patch(module, "get_forward_backward_func",
                          around(module.get_forward_backward_func, training_hooks.forward_backward_func_hook),
                          _GET_FORWARD_BACKWARD_FUNC)
    if not PATCHES.is_patched(model_provider, "_create_model"):
        PATCHES.patch(model_provider, "_create_model", around(model_provider._create_model, _create_model),
                      _CREATE_MODEL)
    answers = _pp_predicates()
    for module, names in ((model_provider, answers), (gpt_step, answers),
                          (batch_utils, ("is_pp_first_stage", "is_pp_last_stage"))):
        for name in names:
            answer, signature = answers[name]
            if not PATCHES.is_patched(module, name):
                PATCHES.patch(module, name, _stage_aware(getattr(module, name), answer), signature)


def disable() -> None:
    """Undo :func:`enable`'s Bridge patches and forget the job (tests, diagnosis)."""
    PATCHES.restore()
    training_hooks.set_active_options(None)


__all__ = ["PATCHES", "disable", "enable"]
