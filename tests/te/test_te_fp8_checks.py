"""Our start-up checks on FP8 settings with Transformer Engine importable: accepted on a TE spec, and
refused exactly where Megatron refuses them.

Without TE, ``--pipeline-schedule`` refuses FP8/FP4 up front (tests/test_megatron_layout.py). Here
each combination is parsed by Megatron's parser and validated by ``validate_args`` through our
patched hook, with its model config then built (``TransformerConfig`` checks FP8 too): once under
Megatron's own schedule (our hook inert: Megatron's verdict) and once under each of ours, at P=2.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from dualpipe_megatron.megatron import refusals, training_hooks
from pretrain_runs import CPU, MODEL

BASE = [*MODEL, *CPU, "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
        "--global-batch-size", "8", "--bf16", "--transformer-impl", "transformer_engine"]
ACCEPTED = {
    "hybrid": ["--fp8-format", "hybrid"],
    "hybrid_tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "e4m3_blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
    "e4m3_mxfp8": ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"],
    "fp8_param_gather": ["--fp8-format", "hybrid", "--fp8-param-gather", "--use-distributed-optimizer"],
    "fp4": ["--fp4-format", "e2m1"],
    # Megatron's validation does not refuse FP8 with local layers (which then run no FP8 GEMM): nor do we.
    "hybrid_local_layers": ["--fp8-format", "hybrid", "--transformer-impl", "local"],
}
REFUSED = {
    "fp8_and_fp4": (["--fp8-format", "hybrid", "--fp4-format", "e2m1"], "cannot be used simultaneously"),
    "param_gather_without_distributed_optimizer": (["--fp8-param-gather"], "only supported with distributed optimizer"),
    "delayed_scaling_bf16_ends": (["--fp8-format", "hybrid", "--first-last-layers-bf16"],
                                  "Delayed scaling does not support first / last layer in BF16"),
    "custom_recipe_without_factory": (["--fp8-format", "hybrid", "--fp8-recipe", "custom"],
                                      "fp8_quantizer_factory must be provided"),
}


@pytest.fixture(scope="module", autouse=True)
def hooks() -> Iterator[None]:
    training_hooks.install()
    yield
    training_hooks.uninstall()


def _verdict(extra: list[str], schedule: str | None) -> tuple[str | None, object]:
    """(None, the model config) if Megatron's parser, ``validate_args`` (through our hook) and the
    config accept ``extra``; else (the error's type and message, None)."""
    from megatron.training import arguments
    from megatron.training.argument_utils import core_transformer_config_from_args

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args([*BASE, *extra, *(["--pipeline-schedule", schedule] if schedule else [])])
    args.rank, args.world_size = 0, 2
    try:
        arguments.validate_args(args, {})
        return None, core_transformer_config_from_args(args)
    except (AssertionError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}", None


def test_transformer_engine_is_found() -> None:
    assert refusals._have_transformer_engine()


def _flag(extra: list[str], flag: str) -> str | None:
    return extra[extra.index(flag) + 1] if flag in extra else None


@pytest.mark.parametrize("name", ACCEPTED)
def test_fp8_settings_are_accepted_as_megatron_accepts_them(name: str) -> None:
    extra = ACCEPTED[name]
    assert _verdict(extra, None)[0] is None
    for schedule in refusals.SCHEDULES:
        refused, config = _verdict(extra, schedule)
        assert refused is None, (schedule, refused)
        assert (config.fp8, config.fp4, config.virtual_pipeline_model_parallel_size) == (
            _flag(extra, "--fp8-format"), _flag(extra, "--fp4-format"), 2), schedule


@pytest.mark.parametrize("name", REFUSED)
def test_what_megatron_refuses_is_refused_alike(name: str) -> None:
    extra, message = REFUSED[name]
    megatron, _ = _verdict(extra, None)
    assert megatron is not None and message in megatron, megatron
    for schedule in refusals.SCHEDULES:
        assert _verdict(extra, schedule)[0] == megatron, schedule
