"""``--pipeline-schedule`` through Megatron's schedule extension point instead of runtime patches.

``patches/megatron-core-0.19.2-schedule-extension-point.patch`` adds
``megatron.training.schedule_plugins`` to megatron-core: the training loop calls a registered
plugin's hooks where :func:`training_hooks.install` would otherwise replace Megatron
functions. :class:`DualPipeSchedulePlugin` implements those hooks with ``training_hooks``'s
own logic, so both routes build, schedule and check exactly the same way. To pick the route
this megatron allows, call :func:`dualpipe_megatron.routes.install_for_megatron` (it also
registers EPLB's flags, which this module must not import).

Still replaced at runtime, on the first ``stage_map_active``: the two stage predicates
(``megatron.core.parallel_state.is_pipeline_first_stage`` and ``is_pipeline_last_stage``), MTP's
``is_vp_last_stage``, ``Float16Module.forward`` and HybridModel's ``select_pipeline_segment``
(``predicates.install_predicates``). They are megatron-core, not the training loop, and our
schedule activates its stage map through them.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any, Callable

from .guard import check_version
from .model import prepare_model
from .schedule import make_forward_backward_func
from .training_hooks import (
    active_options, add_arguments, check_checkpoint_schedule, chunk_pre_post_process, job_embedding_ranks,
    pipeline_position, post_validate, pre_validate,
)

EXTENSION_POINT = "megatron.training.schedule_plugins"


class DualPipeSchedulePlugin:
    """Megatron schedule plugin for ``--pipeline-schedule``; every hook is inert unless the
    validated arguments chose dualpipe or dualpipev."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_arguments(parser)

    def pre_validate_args(self, args: argparse.Namespace) -> None:
        pre_validate(args)

    def post_validate_args(self, args: argparse.Namespace) -> None:
        post_validate(args)

    def get_embedding_ranks(self, args: argparse.Namespace, script_choice: Callable | None) -> Callable | None:
        return job_embedding_ranks(script_choice)

    def model_chunk_pre_post_process(self, args: argparse.Namespace, vp_stage: int | None,
                                     pre_process: bool, post_process: bool) -> tuple[bool, bool]:
        if active_options() is None:
            return pre_process, post_process
        return chunk_pre_post_process(vp_stage, *pipeline_position())

    def finalize_model(self, args: argparse.Namespace, model: list[Any]) -> list[Any]:
        options = active_options()
        if options is not None:
            prepare_model(model, options, *pipeline_position())
        return model

    def get_forward_backward_func(self, args: argparse.Namespace, **_: Any) -> Callable | None:
        options = active_options()
        return None if options is None else make_forward_backward_func(options)

    def check_checkpoint_args(self, args: argparse.Namespace, checkpoint_args: Any) -> None:
        # Megatron has already run its own checks; only ours remain.
        check_checkpoint_schedule(args, checkpoint_args)


PLUGIN = DualPipeSchedulePlugin()


def has_extension_point() -> bool:
    """Whether the installed megatron carries the schedule extension point (the patch)."""
    return importlib.util.find_spec(EXTENSION_POINT) is not None


def register() -> DualPipeSchedulePlugin:
    """Register :data:`PLUGIN` with the patched megatron (idempotent); call before Megatron
    parses its arguments."""
    check_version()
    if not has_extension_point():
        raise RuntimeError(
            f"{EXTENSION_POINT} not found: apply patches/megatron-core-0.19.2-schedule-extension-"
            f"point.patch to megatron-core, or use training_hooks.install() (runtime patches)")
    importlib.import_module(EXTENSION_POINT).register_schedule_plugin(PLUGIN)
    return PLUGIN


__all__ = ["EXTENSION_POINT", "PLUGIN", "DualPipeSchedulePlugin", "has_extension_point", "register"]
