"""The DeepSeek-V3 proxy's chunks with Transformer Engine layers under DualPipeV and DualPipe, and our
weight-gradient deferral over every TE linear in them (4 CPU ranks: EP=2 x P=2, gloo).

``scripts/deepseek_v3_proxy.flags`` (MLA, dense-then-MoE with a shared expert and expert bias, MTP;
EPLB's flags dropped) with ``--transformer-impl transformer_engine``, grouped-GEMM experts,
``--delay-wgrad-compute`` and the EP overlap it requires, built on each rank by
``te_chunks_job.py`` through ``megatron.training``'s builder route. Checked per schedule: each
chunk holds its stage's layers (the embedding on stage 0, the output layer, MTP and its embedding
copy on the loss stage), every
TE linear has TE's delayed wgrad on, and the W of a ``w:false`` backward runs TE's own
``backward_dw`` on each of them exactly once, none during the B. TE's math (the GEMM the W pops)
needs a GPU: scripts/gpu_check.sh.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpipe_megatron.megatron.refusals import stage_map_for
from launcher import LaunchFailed, marked_json
from pretrain_runs import run
from test_deepseek_v3_proxy import proxy_flags

JOB = Path(__file__).with_name("te_chunks_job.py")
EPLB = ("--eplb-interval", "--eplb-window", "--eplb-threshold", "--eplb-gpus-per-node")
TE_FLAGS = ["--transformer-impl", "transformer_engine", "--bf16", "--moe-grouped-gemm",
            "--delay-wgrad-compute", "--overlap-moe-expert-parallel-comm"]
PP, LAYERS = 2, 8


@pytest.fixture(scope="module", params=["dualpipev", "dualpipe"])
def reports(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    schedule = request.param
    try:
        log = run(schedule, tmp_path_factory.mktemp(f"te_{schedule}"), 4,
                  [*proxy_flags(drop=EPLB), *TE_FLAGS, "--pipeline-schedule", schedule], script=JOB)
    except LaunchFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    found = marked_json(log, "TE_CHUNKS")
    assert sorted(r["rank"] for r in found) == [0, 1, 2, 3], log[-3000:]
    return schedule, found


def _chunks(reports: tuple[str, list[dict]]):
    """(stage map, pipeline rank, chunk report) for every chunk of every rank."""
    schedule, found = reports
    stage_map = stage_map_for(schedule, PP)
    return [(stage_map, r["pipeline_rank"], chunk) for r in found for chunk in r["chunks"]]


def test_each_chunk_holds_its_stage(reports: tuple[str, list[dict]]) -> None:
    for stage_map, rank, chunk in _chunks(reports):
        stage = stage_map.stage(rank, chunk["vp_stage"])
        first, last = stage == 0, stage == stage_map.num_stages - 1
        per_stage = LAYERS // stage_map.num_stages
        where = f"rank {rank} chunk {chunk['vp_stage']} (stage {stage})"
        assert chunk["pre_process"] == first, where
        assert chunk["embedding"] == (first or last), where  # the loss stage's copy feeds MTP
        assert (chunk["post_process"], chunk["output_layer"]) == (last, last), where
        assert chunk["mtp_layers"] == int(last), where
        assert chunk["layers"] == list(range(stage * per_stage + 1, (stage + 1) * per_stage + 1)), where


def test_every_te_linear_delays_its_weight_grad(reports: tuple[str, list[dict]]) -> None:
    kinds = set()
    for _, rank, chunk in _chunks(reports):
        kinds |= set(chunk["linears"])
        assert chunk["delayed"] == sum(chunk["linears"].values()) > 0, (rank, chunk)
    # MLA's projections, dense and shared-expert MLPs, the grouped experts, MTP's eh_proj.
    assert {"TELinear", "TELayerNormColumnParallelLinear", "TEColumnParallelLinear", "TERowParallelLinear",
            "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear"} <= kinds, kinds


def test_w_runs_tes_backward_dw_of_every_te_linear(reports: tuple[str, list[dict]]) -> None:
    for _, rank, chunk in _chunks(reports):
        where = f"rank {rank} chunk {chunk['vp_stage']}"
        assert chunk["ran_in_b"] == 0, f"{where}: TE's backward_dw ran inside the B, not at its W"
        # One filed closure per layer slot with weight grads: mlp and pre_dispatch, decoder and MTP layers.
        assert chunk["filed"] == 2 * (len(chunk["layers"]) + chunk["mtp_layers"]), where
        assert chunk["not_reached"] == [], f"{where}: W never reaches {chunk['not_reached']}"
        assert chunk["reached_not_delayed"] == [] and chunk["te_gated_off"] == [], (where, chunk)
        assert chunk["reached_once"], where
