"""``dualpipe_megatron.bridge.enable`` on Bridge's own config objects, in one process: what it sets,
what it refuses, which bindings it hooks, and how the hooked stage predicates answer."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from megatron.core import parallel_state

from dualpipe_megatron.bridge import route, version
from dualpipe_megatron.megatron import training_hooks
from dualpipe_megatron.megatron.predicates import set_job_stage_map
from dualpipe_megatron.megatron.refusals import stage_map_for
from dualpipe_megatron.megatron.topology import DualPipeLayout


def _config(**model: object) -> SimpleNamespace:
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.config import DistributedDataParallelConfig

    fields = dict(num_layers=4, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=2,
                  pipeline_dtype=torch.float32) | model
    return SimpleNamespace(model=GPTModelProvider(**fields), ddp=DistributedDataParallelConfig())


@pytest.fixture(autouse=True)
def _disabled():
    yield
    route.disable()
    set_job_stage_map(None)


def _bindings():
    from megatron.bridge.models import model_provider
    from megatron.bridge.training import eval as bridge_eval, gpt_step, train
    from megatron.bridge.training.utils import batch_utils

    names = ("is_pp_first_stage", "is_pp_last_stage", "is_vp_first_stage", "is_vp_last_stage")
    return ([(train, "get_forward_backward_func"), (bridge_eval, "get_forward_backward_func"),
             (model_provider, "_create_model")] + [(model_provider, n) for n in names]
            + [(gpt_step, n) for n in names] + [(batch_utils, n) for n in names[:2]])


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_enable_sets_our_placement_and_hooks_bridge(schedule: str) -> None:
    cfg = _config()
    before = {(module.__name__, name): getattr(module, name) for module, name in _bindings()}
    options = route.enable(cfg, schedule)
    assert options.schedule == schedule and training_hooks.active_options() is options
    assert cfg.model.virtual_pipeline_model_parallel_size == 2
    assert isinstance(cfg.model.pipeline_model_parallel_layout, DualPipeLayout)
    assert cfg.model.overlap_p2p_comm is False and cfg.ddp.align_param_gather is False
    assert all(getattr(module, name) is not before[(module.__name__, name)] for module, name in _bindings())
    route.disable()
    assert all(getattr(module, name) is before[(module.__name__, name)] for module, name in _bindings())
    assert training_hooks.active_options() is None


@pytest.mark.parametrize("model,options,message", [
    ({}, {"schedule": "zb1p"}, "unknown pipeline schedule 'zb1p'"),
    ({"pipeline_model_parallel_size": 1}, {}, "needs pipeline-model-parallel size >= 2"),
    ({"virtual_pipeline_model_parallel_size": 2}, {}, "drop cfg.model.virtual_pipeline_model_parallel_size"),
    ({"num_layers": 6}, {"layout": "Et|t|tt|tL"}, "dualpipev"),
    ({"num_layers": 3}, {}, "dualpipev"),
])
def test_enable_refuses_what_our_schedules_cannot_run(model: dict, options: dict, message: str) -> None:
    cfg = _config(**model)
    given = cfg.model.virtual_pipeline_model_parallel_size
    with pytest.raises(ValueError, match=message):
        route.enable(cfg, **({"schedule": "dualpipev"} | options))
    assert training_hooks.active_options() is None and cfg.model.virtual_pipeline_model_parallel_size == given


def test_another_bridge_release_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(version.metadata, "version", lambda name: "0.7.0")
    with pytest.raises(RuntimeError, match="megatron-bridge 0.7.0 is not supported"):
        route.enable(_config(), "dualpipev")


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_hooked_predicates_give_each_chunk_its_role(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bridge's ``pre_process = is_vp_first_stage(i) and is_pp_first_stage(pp)`` (and the last-stage
    twin, and get_batch's) must give each chunk the role our stage map gives it."""
    from megatron.bridge.models import model_provider
    from megatron.bridge.training import gpt_step

    route.enable(_config(), schedule)
    stage_map = stage_map_for(schedule, 2)
    set_job_stage_map(stage_map)
    group = SimpleNamespace(rank=lambda: 0, size=lambda: 2)
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", functools.partial(int, rank))
        for module in (model_provider, gpt_step):
            for chunk in range(2):
                first = module.is_vp_first_stage(vp_stage=chunk, vp_size=2) and module.is_pp_first_stage(group)
                last = module.is_vp_last_stage(vp_stage=chunk, vp_size=2) and module.is_pp_last_stage(group)
                assert (first, last) == (stage_map.is_first(rank, chunk), stage_map.is_last(rank, chunk)), \
                    (module.__name__, rank, chunk)
    set_job_stage_map(None)
    assert model_provider.is_vp_last_stage(vp_stage=1, vp_size=2)  # Megatron's own answer again
    assert not model_provider.is_vp_last_stage(vp_stage=0, vp_size=2)


def test_the_deepseek_v3_recipe_layout_of_the_docs() -> None:
    """docs/training.md's example: Bridge's DeepSeek-V3 recipe (61 layers, MTP 1, PP 16) under
    dualpipev with its layout string. (The recipe itself reads DeepSeek-V3's config from Hugging
    Face, which this machine cannot reach: its shape is set here.)"""
    cfg = _config(num_layers=61, mtp_num_layers=1, pipeline_model_parallel_size=16)
    route.enable(cfg, "dualpipev", layout="Et|(tt|)*29t|tmL")
    layout = cfg.model.pipeline_model_parallel_layout
    assert layout.stage_map.num_stages == 32 and cfg.model.virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ValueError, match="needs 32"):
        route.enable(_config(num_layers=61, mtp_num_layers=1, pipeline_model_parallel_size=16), "dualpipev",
                     layout="Et|(tt|)*29ttmL")
