"""Placement, layer numbering, stage predicates and configuration errors (no processes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType

from dualpipe_megatron.megatron.model import chunk_roles, check_configuration, dualpipe_layout
from dualpipe_megatron.megatron.predicates import running_chunk, stage_map_active
from dualpipe_megatron.megatron.refusals import UNBUILT, chunk_role_problems, stage_map_for, step_problems

pytestmark = pytest.mark.unit


def test_dualpipev_roles_put_embedding_and_loss_on_rank_0() -> None:
    stage_map = stage_map_for("dualpipev", 4)
    roles = [chunk_roles(stage_map, r) for r in range(4)]
    assert [[(x.stage, x.pre_process, x.post_process) for x in rank] for rank in roles] == [
        [(0, True, False), (7, False, True)],
        [(1, False, False), (6, False, False)],
        [(2, False, False), (5, False, False)],
        [(3, False, False), (4, False, False)],
    ]


def test_dualpipe_roles_mirror_the_model() -> None:
    stage_map = stage_map_for("dualpipe", 4)
    stages = [[x.stage for x in chunk_roles(stage_map, r)] for r in range(4)]
    assert stages == [[0, 3], [1, 2], [2, 1], [3, 0]]
    ends = [[(x.pre_process, x.post_process) for x in chunk_roles(stage_map, r)] for r in (0, 3)]
    assert ends == [[(True, False), (False, True)], [(False, True), (True, False)]]


def test_chunks_built_for_looped_placement_are_named_with_what_was_expected() -> None:
    """Megatron's own rule (pre on rank 0 chunk 0, post on the last rank's last chunk) where the
    V wants both ends on rank 0: each wrong chunk is named with the flags it should have had."""
    from torch import nn

    def chunk(pre: bool, post: bool) -> nn.Module:
        module = nn.Module()
        module.pre_process, module.post_process = pre, post
        return module

    stage_map = stage_map_for("dualpipev", 2)
    assert chunk_role_problems([chunk(True, False), chunk(False, True)], stage_map, 0) == []
    looped = chunk_role_problems([chunk(True, False), chunk(False, False)], stage_map, 0)
    assert looped == ["chunk 1 of pipeline rank 0 (model stage 3) has pre_process=False, post_process=False; "
                      "expected pre_process=False, post_process=True"]
    assert len(chunk_role_problems([chunk(False, False), chunk(False, True)], stage_map, 1)) == 1
    assert "build_virtual_pipeline_stages" in UNBUILT and "prepare_model" in UNBUILT


def test_even_layout_numbers_layers_in_model_order() -> None:
    layout = dualpipe_layout("dualpipev", 2, 8)
    offsets = [[layout.get_layer_offset(vp_stage=c, pp_rank=r) for c in range(2)] for r in range(2)]
    assert offsets == [[0, 6], [2, 4]]
    assert layout.layout[0][0][0] == LayerType.embedding and layout.layout[0][1][-1] == LayerType.loss
    layout.validate_layer_layout(num_layers=8, mtp_num_layers=None)


def test_megatron_layout_string_is_read_in_stage_order() -> None:
    layout = dualpipe_layout("dualpipev", 2, 6, "Et|tt|tt|tL")
    offsets = [[layout.get_layer_offset(vp_stage=c, pp_rank=r) for c in range(2)] for r in range(2)]
    assert offsets == [[0, 5], [1, 3]]
    assert [[len([t for t in layout.layout[r][c] if t == LayerType.decoder]) for c in range(2)]
            for r in range(2)] == [[1, 1], [2, 2]]
    assert repr(layout) == "Et|tt|tt|tL"


def test_dualpipe_layout_offsets_follow_each_direction() -> None:
    layout = dualpipe_layout("dualpipe", 4, 8)
    offsets = [[layout.get_layer_offset(vp_stage=c, pp_rank=r) for c in range(2)] for r in range(4)]
    assert offsets == [[0, 6], [2, 4], [4, 2], [6, 0]]


def test_mtp_layers_sit_with_the_loss() -> None:
    """DualPipeV's loss stage is chunk 1 of rank 0 (Megatron's own check refuses MTP on the first
    rank); DualPipe's are chunk 0 of the last rank and chunk 1 of rank 0."""
    v = dualpipe_layout("dualpipev", 2, 8, mtp_layers=2)
    assert repr(v) == "Ett|tt|tt|ttmmL"
    assert [[chunk.count(LayerType.mtp) for chunk in rank] for rank in v.layout] == [[0, 2], [0, 0]]
    assert v.validate_layer_layout(num_layers=8, mtp_num_layers=2) is False
    both = dualpipe_layout("dualpipe", 4, 8, "Ett|tt|tt|ttmL", mtp_layers=1)
    assert [[chunk.count(LayerType.mtp) for chunk in both.layout[r]] for r in (0, 3)] == [[0, 1], [1, 0]]
    with pytest.raises(ValueError, match=r"2 MTP layers \(m\) for --mtp-num-layers 1"):
        v.validate_layer_layout(num_layers=8, mtp_num_layers=1)


@pytest.mark.parametrize("args,message", [
    # Schedule rules come from the generators, in the context of Megatron's sizes.
    (("dualpipe", 3, 12, 6), "(pipeline-model-parallel size 3, 12 micro-batches per step): dualpipe needs an "
                             "even number of ranks >= 2, got 3"),
    (("dualpipe", 4, 9, 8), "dualpipe needs an even number of microbatches, got 9"),
    (("dualpipev", 4, 7, 8), "needs microbatches >= 2*ranks (8), got 7; raise --global-batch-size"),
    (("dualpipe", 4, 6, 8), "needs microbatches >= 2*ranks (8), got 6; raise --global-batch-size"),
    (("dualpipev", 2, 4, 6), "num_layers (6) is not divisible by the 4 pipeline stages"),
    (("dualpipev", 2, 4, 6, "Et|tt|tL"), "pipeline layout has 3 stages; this schedule needs 4"),
    (("dualpipev", 2, 4, 6, "Et|tt|tt|tL", 1), "0 MTP layers (m) for --mtp-num-layers 1"),
    (("dualpipev", 2, 4, 6, "Et|tt|tm|tL", 1), "MTP layers (m) must sit together just before the loss"),
    (("dualpipev", 2, 4, 6, "Et|tt|tt|ttL"), "7 decoder layers (t) for --num-layers 6"),
    (("dualpipev", 2, 4, 6, "tE|tt|tt|tL"), "the embedding (E) must open the first stage"),
    (("zigzag", 2, 4, 4), "unknown pipeline schedule 'zigzag'"),
    (("dualpipev", 1, 4, 4), "needs pipeline-model-parallel size >= 2"),
])
def test_configuration_errors(args: tuple, message: str) -> None:
    with pytest.raises(ValueError) as err:
        check_configuration(*args)
    assert message in str(err.value)


def test_unsupported_options_are_named_with_reasons() -> None:
    config = SimpleNamespace(variable_seq_lengths=True, mtp_num_layers=1,
                             overlap_moe_expert_parallel_comm=True, defer_embedding_wgrad_compute=True)
    reasons = step_problems(config, True, lambda x: x)
    assert [r.split(" ")[0] for r in reasons] == [
        "variable_seq_lengths", "defer_embedding_wgrad_compute", "collect_non_loss_data", "adjust_tensor_shapes_fn",
    ]
    clean = SimpleNamespace(variable_seq_lengths=False, mtp_num_layers=None)
    assert step_problems(clean, False, None) == []


@pytest.fixture
def pipeline_rank():
    """Pretend to be a given pipeline rank of 4 with 2 virtual stages."""
    def set_rank(rank: int) -> None:
        parallel_state.set_pipeline_model_parallel_rank(rank)
        parallel_state.set_pipeline_model_parallel_world_size(4)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
    yield set_rank
    parallel_state.set_pipeline_model_parallel_rank(None)
    parallel_state.set_pipeline_model_parallel_world_size(None)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def test_predicates_answer_for_the_chunk_being_run(pipeline_rank) -> None:
    pipeline_rank(0)
    with stage_map_active(stage_map_for("dualpipev", 4)):
        first, last = parallel_state.is_pipeline_first_stage, parallel_state.is_pipeline_last_stage
        assert first(ignore_virtual=False, vp_stage=0) and not last(ignore_virtual=False, vp_stage=0)
        assert last(ignore_virtual=False, vp_stage=1) and not first(ignore_virtual=False, vp_stage=1)
        assert first() and last()  # rank 0 holds both ends
        with running_chunk(1):
            assert last() and not first()
        pipeline_rank(3)
        assert not first() and not last()
    # Outside our schedule Megatron's own answers come back: rank 3 of 4 is the last.
    assert last(ignore_virtual=False, vp_stage=1) and not last(ignore_virtual=False, vp_stage=0)


def _args(**kw: object) -> SimpleNamespace:
    base = dict(pipeline_schedule=None, virtual_pipeline_model_parallel_size=None,
                use_distributed_optimizer=True, no_load_optim=False,
                dist_ckpt_optim_fully_reshardable=False)
    return SimpleNamespace(**{**base, **kw})


def test_distributed_optimizer_state_of_another_schedule_is_refused() -> None:
    from dualpipe_megatron.megatron.training_hooks import check_checkpoint_schedule

    saved = _args(pipeline_schedule="dualpipev", virtual_pipeline_model_parallel_size=2)
    with pytest.raises(RuntimeError, match="saved under --pipeline-schedule dualpipev, the run uses 1f1b"):
        check_checkpoint_schedule(_args(), saved)
    # Fine: same schedule, no optimizer load, a reshardable format, or a plain optimizer.
    check_checkpoint_schedule(_args(pipeline_schedule="dualpipev"), saved)
    check_checkpoint_schedule(_args(no_load_optim=True), saved)
    check_checkpoint_schedule(_args(dist_ckpt_optim_fully_reshardable=True), saved)
    check_checkpoint_schedule(_args(use_distributed_optimizer=False), saved)
    # A checkpoint from before the flag existed counts as Megatron's own choice.
    check_checkpoint_schedule(_args(pipeline_schedule="1f1b"), SimpleNamespace())


def test_fp8_without_transformer_engine_is_refused() -> None:
    import importlib.util

    from dualpipe_megatron.megatron.training_hooks import pre_validate

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    args = SimpleNamespace(pipeline_schedule="dualpipev", pipeline_model_parallel_size=2, num_layers=4,
                           dualpipe_layout=None, fp8="e4m3", pipeline_model_parallel_layout=None,
                           num_layers_per_virtual_pipeline_stage=None,
                           num_virtual_stages_per_pipeline_rank=None,
                           decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None)
    with pytest.raises(ValueError, match="with FP8/FP4 needs Transformer Engine, which is not installed"):
        pre_validate(args)
    args.fp8 = None
    pre_validate(args)  # the same configuration without FP8 is fine
