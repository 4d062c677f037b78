"""Automatic ``--dualpipe-layout``: the FLOP model, the split search, its CLI and ``auto_layout``
on Megatron's parsed arguments (no Megatron processes)."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace
from itertools import product
from fractions import Fraction
from pathlib import Path

import pytest

from dualpipe_megatron.schedules.cli import main
from dualpipe_megatron.schedules.ir import ScheduleError
from dualpipe_megatron.schedules.layout import (LayerCosts, Split, _Search, best_counts, best_layout, even_counts,
                                                layout_string, parse_moe_layer_freq, stage_costs_for)
from dualpipe_megatron.schedules.model_shape import ModelShape, cost_of, total
from dualpipe_megatron.schedules.registry import build_schedule
from dualpipe_megatron.schedules.simulate import StageCost, simulate

pytestmark = pytest.mark.unit

# bench/bench_megatron.py's dense-p2 model (8 layers, hidden 256, 4 heads, seq 128, micro-batch 2, vocab 1024).
DENSE = ModelShape(num_layers=8, hidden=256, heads=4, seq=128, micro_batch=2, vocab=1024)
BIG_VOCAB = replace(DENSE, vocab=32000)  # the output layer and loss cost about ten layers
# DeepSeek-V3's structure in small: dense layers first, then MoE with a shared expert, one MTP layer.
MOE_MTP = ModelShape(num_layers=12, hidden=128, heads=4, seq=64, vocab=4096, gated=True, experts=8, topk=2,
                     moe_ffn=64, shared_ffn=64, moe_layer_freq=(0, 0) + (1,) * 10, mtp_layers=1)
CASES = [("dualpipev", 2, 8, DENSE), ("dualpipev", 2, 8, BIG_VOCAB), ("dualpipe", 2, 8, BIG_VOCAB),
         ("dualpipev", 3, 6, MOE_MTP), ("dualpipev", 4, 8, MOE_MTP), ("dualpipe", 4, 16, MOE_MTP)]
MODEL_FLAGS = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
               "--micro-batch-size", "2", "--vocab-size", "32000"]


def counts_of(layout: str) -> list[int]:
    return [stage.count("t") for stage in layout.split("|")]


def even_step(schedule: str, P: int, M: int, costs: LayerCosts) -> Fraction:
    sched = build_schedule(schedule, P, M)
    return simulate(sched, stage_costs_for(sched, costs, even_counts(costs.num_layers, sched.stages))).makespan


@pytest.mark.parametrize(("schedule", "P", "M", "shape"), CASES)
def test_layout_is_valid_and_never_slower_than_even(schedule: str, P: int, M: int, shape: ModelShape) -> None:
    from dualpipe_megatron.megatron.topology import layout_problems, stage_layer_types

    costs = LayerCosts.from_shape(shape)
    layout, stage_costs, step = best_layout(schedule, P, M, costs)
    sched = build_schedule(schedule, P, M)
    stages = stage_layer_types(shape.num_layers, sched.stages, layout, shape.mtp_layers)
    assert layout_problems(stages, shape.num_layers, shape.mtp_layers) == []
    assert stage_costs == stage_costs_for(sched, costs, counts_of(layout))
    assert step == simulate(sched, stage_costs).makespan <= even_step(schedule, P, M, costs)


def test_heavy_loss_stage_gets_fewer_layers_under_dualpipev() -> None:
    costs = LayerCosts.from_shape(BIG_VOCAB)
    assert costs.loss.F > 9 * costs.decoder[0].F
    layout, _, step = best_layout("dualpipev", 2, 8, costs)
    counts = counts_of(layout)
    assert counts[0] + counts[-1] < 4  # rank 0 holds the first and the last stage
    assert step < Fraction(95, 100) * even_step("dualpipev", 2, 8, costs)


@pytest.mark.parametrize(("schedule", "P", "M", "per_stage"), [
    ("dualpipev", 2, 4, 1), ("dualpipev", 2, 8, 3), ("dualpipev", 3, 12, 2), ("dualpipev", 4, 8, 2),
    ("dualpipe", 2, 8, 4), ("dualpipe", 4, 8, 2)])
def test_uniform_layers_without_embedding_or_loss_cost_split_evenly(schedule: str, P: int, M: int,
                                                                     per_stage: int) -> None:
    stages = build_schedule(schedule, P, M).stages
    nothing, layer = StageCost(Fraction(0), Fraction(0), Fraction(0)), StageCost(Fraction(1), Fraction(2), Fraction(1))
    layout, _, _ = best_layout(schedule, P, M, LayerCosts(nothing, (layer,) * (stages * per_stage), nothing))
    assert counts_of(layout) == [per_stage] * stages


def test_dense_then_moe_layers_and_mtp_are_costed_in_place() -> None:
    costs = LayerCosts.from_shape(MOE_MTP)
    dense, moe = costs.decoder[0], costs.decoder[2]
    assert costs.decoder[:2] == (dense, dense) and set(costs.decoder[2:]) == {moe} and dense != moe
    # An MTP layer: an embedding lookup, a (2h -> h) projection, a layer like the last, its own output and loss.
    h, tokens = MOE_MTP.hidden, MOE_MTP.tokens
    assert costs.mtp[0].F == costs.embedding.F + 2 * tokens * 2 * h * h + moe.F + costs.loss.F
    layout, stage_costs, _ = best_layout("dualpipev", 3, 6, costs)
    counts = counts_of(layout)
    assert layout.endswith("mL") and counts[-1] < 2  # MTP + output + loss already weigh ~2 layers
    last = stage_costs.stages[(0, 5)]
    assert last.F == sum(c.F for c in costs.decoder[12 - counts[-1]:]) + costs.mtp[0].F + costs.loss.F


def test_mtp_only_last_stage_is_allowed() -> None:
    """DeepSeek-V3's own layout ends in 'mL': the MTP layer carries a transformer layer."""
    heavy = replace(MOE_MTP, num_layers=6, moe_layer_freq=(0,) + (1,) * 5, vocab=100_000)
    layout, _, _ = best_layout("dualpipev", 2, 8, LayerCosts.from_shape(heavy))
    assert layout.split("|")[-1] == "mL" and min(counts_of(layout)[:-1]) >= 1


def test_flop_model_matches_the_projection_counter() -> None:
    """On the projection's MLA+MoE layer, the one FLOP count (which the projection's count_chunk
    reports) equals torch's FLOP counter, which counts causal attention as the full square: the
    half above the mask (B: twice it, W: none) is added to ours."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from dualpipe_megatron.projection.count import count_chunk
    from dualpipe_megatron.projection.layer import build_chunk, chunk_input
    from dualpipe_megatron.projection.shapes import PRESETS
    from dualpipe_megatron.runtime.wgrad import WeightGradStore, deferring

    def flops(fn) -> int:
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    p = PRESETS["tiny"]
    chunk = build_chunk(p, "meta", torch.bfloat16)
    out: list[torch.Tensor] = []
    f = flops(lambda: out.append(chunk(chunk_input(p, "meta", torch.bfloat16))))
    grad = torch.empty_like(out[0])
    b = flops(lambda: out[0].backward(grad))
    y = chunk(chunk_input(p, "meta", torch.bfloat16))
    with deferring("flop-test"):
        b_input = flops(lambda: y.backward(grad))
    w = flops(lambda: WeightGradStore.pop("flop-test"))
    half = p.micro_batch * p.heads * p.seq * p.seq * (p.qk_head_dim + p.qk_pos_dim + p.v_head_dim)
    assert half == p.causal_half().F
    ours, layer = count_chunk(p), p.decoder(moe=True)
    assert (ours.F, ours.B, ours.W) == (layer.F, layer.B, layer.W)
    assert (ours.F + half, ours.B + 2 * half, ours.B_input + 2 * half, ours.W) == (f, b, b_input, w)


def test_fast_timer_equals_simulate() -> None:
    rng = random.Random(3)
    for schedule, P, M in (("dualpipev", 3, 9), ("dualpipe", 4, 8)):
        sched = build_schedule(schedule, P, M)
        for _ in range(3):
            L = sched.stages + rng.randint(0, 6)
            costs = LayerCosts(StageCost(Fraction(rng.randint(0, 3)), Fraction(1), Fraction(0)),
                               tuple(StageCost(Fraction(f), Fraction(2 * f + 1), Fraction(rng.randint(0, f)))
                                     for f in (rng.randint(1, 5) for _ in range(L))),
                               StageCost(Fraction(7, 3), Fraction(5), Fraction(1)))
            ratio, c = Fraction(4, 5), Fraction(1, 3)
            search = _Search(sched, costs, ratio, c)
            for counts in (even_counts(L, sched.stages), [1] * (sched.stages - 1) + [L - sched.stages + 1]):
                got = Fraction(search.key(Split(tuple(counts)))[0], search.unit * search.timer.scale)
                assert got == simulate(sched, stage_costs_for(sched, costs, counts, ratio, c)).makespan


def test_deterministic_and_ties_go_to_the_more_even_split() -> None:
    costs = LayerCosts.from_shape(MOE_MTP)
    first = best_layout("dualpipev", 4, 8, costs, "0.8", "1e6")
    assert best_layout("dualpipev", 4, 8, LayerCosts.from_json_obj(costs.to_json_obj()), "0.8", "1e6") == first
    # A layer moved between rank 1's two stages: the same simulated step, and the even split wins.
    nothing, layer = StageCost(Fraction(0), Fraction(0), Fraction(0)), StageCost(Fraction(1), Fraction(2), Fraction(1))
    search = _Search(build_schedule("dualpipev", 2, 4), LayerCosts(nothing, (layer,) * 8, nothing), Fraction(1),
                     Fraction(0))
    even, moved = search.key(Split((2, 2, 2, 2))), search.key(Split((2, 3, 1, 2)))
    assert even[0] == moved[0] and even < moved and search.descend(Split((2, 3, 1, 2)))[2] == Split((2, 2, 2, 2))


@pytest.mark.parametrize(("counts", "layout"), [((4, 4, 4, 0), "Etttt|tttt|ttttm|L"),
                                                ((5, 7, 0, 0), "Ettttt|ttttttt|m|L"),
                                                ((0, 6, 6, 0), "E|tttttt|ttttttm|L")])
def test_loss_alone_is_a_layout_megatron_accepts_and_is_costed_in_place(counts: tuple[int, ...],
                                                                        layout: str) -> None:
    """The loss alone in the last stage, the MTP layer closing the one before (alone: ``m|L``), as
    Megatron's own parser reads it for interleaved P=2 (2 virtual stages each); the loss's stage
    also computes the MTP layer's output layer and loss, as Megatron's post-process does."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    assert layout_string(counts, 1, loss_alone=True) == layout
    parsed = PipelineParallelLayerLayout(layout, 2)
    assert parsed.virtual_pipeline_model_parallel_size == 2
    assert parsed.validate_layer_layout(num_layers=12, mtp_num_layers=1) is True  # its mtp_standalone
    costs = LayerCosts.from_shape(MOE_MTP)
    stages = [costs.stage_cost(counts, s, loss_alone=True) for s in range(4)]
    assert stages[3] == total([costs.loss, costs.loss])
    assert stages[2] == total([*costs.decoder[12 - counts[2]:], costs.mtp[0] + costs.loss * -1])
    assert stages[0] == total([costs.embedding, *costs.decoder[:counts[0]]])
    assert total(stages) == total([costs.embedding, *costs.decoder, *costs.mtp, costs.loss])
    with pytest.raises(ScheduleError, match="the loss alone in the last stage, yet 1 decoder"):
        stage_costs_for(build_schedule("interleaved", 2, 4, 2), costs, (4, 4, 3, 1), loss_alone=True)


# Six equal layers; the MTP layer (a layer, a projection, its own output layer and loss) and the
# loss weigh five layers' F together.
LAYER, HEAD = cost_of(1, 2, 1), cost_of(2, 4, 0)
TAIL_HEAVY = LayerCosts(cost_of(0, 0, 0), (LAYER,) * 6, HEAD, (total([LAYER, cost_of(1, 1, 0), HEAD]),))


def test_megatron_search_puts_the_loss_alone_when_that_is_fastest() -> None:
    sched = build_schedule("interleaved", 2, 8, 2)

    def step(split: Split) -> Fraction:
        return simulate(sched, stage_costs_for(sched, TAIL_HEAVY, split.counts, 1, 0, split.loss_alone)).makespan

    ours = best_counts(sched, TAIL_HEAVY, Fraction(1), Fraction(0))
    megatron = best_counts(sched, TAIL_HEAVY, Fraction(1), Fraction(0), megatron=True)
    assert ours == Split((3, 1, 2, 0)) and megatron == Split((2, 2, 2, 0), True)
    assert step(megatron) == 155 < step(ours) == 178
    search = _Search(sched, TAIL_HEAVY, Fraction(1), Fraction(0), megatron=True)
    assert Fraction(search.key(megatron)[0], search.unit * search.timer.scale) == step(megatron)
    every = [Split(c, alone) for alone in (False, True) for c in product(range(7), repeat=4)
             if sum(c) == 6 and all(n >= f for n, f in zip(c, search.floors[alone])) and not (alone and c[3])]
    assert len(every) == 56 and min(map(step, every)) == step(megatron)  # the best Megatron accepts here


def test_moe_layer_freq_is_parsed_like_megatron() -> None:
    assert parse_moe_layer_freq("([0]*3+[1]*5)") == (0, 0, 0, 1, 1, 1, 1, 1)
    assert parse_moe_layer_freq(" 2 ") == 2 and parse_moe_layer_freq("[1,0]*2") == (1, 0, 1, 0)
    assert replace(DENSE, experts=4, moe_layer_freq=2).moe_layers() == (True, False) * 4
    for bad in ("__import__('os')", "[0]*1000000", "[0.5]", "[0]+1", "x"):
        with pytest.raises(ScheduleError, match="moe-layer-freq"):
            parse_moe_layer_freq(bad)
    with pytest.raises(ScheduleError, match="one 0/1 per layer"):
        replace(DENSE, experts=4, moe_layer_freq=(1, 0))


def test_cli_prints_the_layout_then_the_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["layout", "--schedule", "dualpipev", "-P", "2", "-M", "8", *MODEL_FLAGS]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = best_layout("dualpipev", 2, 8, LayerCosts.from_shape(BIG_VOCAB))
    assert lines[0] == expected[0]
    assert sum(line.startswith("| ") for line in lines) == 2 + 4  # header, rule, one row per stage
    assert lines[-1].startswith(f"simulated step: {float(expected[2]):.4g}; even split Ett|tt|tt|ttL: ")
    assert lines[-1].endswith("%)") and "(-" in lines[-1]
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(LayerCosts.from_shape(BIG_VOCAB).to_json_obj()))
    assert main(["layout", "--schedule", "dualpipev", "-P", "2", "-M", "8", "--layer-costs", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == expected[0]


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--schedule", "dualpipev", "--num-layers", "3", "--hidden-size", "8", "--seq-length", "8",
      "--vocab-size", "8"], "3 decoder layers cannot give each of the 4 stages one"),
    (["--schedule", "1f1b", *MODEL_FLAGS], "layout search is for dualpipev and dualpipe"),
    (["--schedule", "dualpipev", "--num-layers", "8"], "needs --hidden-size, --seq-length, --vocab-size"),
    (["--schedule", "dualpipev", *MODEL_FLAGS, "--num-experts", "4", "--moe-layer-freq", "[1]*3"],
     "one 0/1 per layer (8)"),
    (["--schedule", "dualpipev", "--layer-costs", "x.json", "--hidden-size", "8"], "drop --hidden-size"),
    (["--schedule", "dualpipev", *MODEL_FLAGS, "--fb-ratio", "x"], "bad fb_ratio or c"),
    (["--schedule", "dualpipev", *MODEL_FLAGS, "--kv-channels", "0"], "kv_channels must be >= 1"),
    (["--schedule", "dualpipe", "-P", "3", *MODEL_FLAGS], "even number of ranks"),
])
def test_cli_bad_input_is_one_error_line_and_status_2(capsys: pytest.CaptureFixture[str], extra: list[str],
                                                     fragment: str) -> None:
    assert main(["layout", "-P", "2", "-M", "8", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err


def test_auto_layout_from_megatron_arguments() -> None:
    from megatron.training.arguments import add_megatron_arguments

    from dualpipe_megatron.megatron.auto_layout import auto_layout, model_shape
    from dualpipe_megatron.megatron.model import check_configuration
    from dualpipe_megatron.megatron.training_hooks import add_arguments

    parser = add_arguments(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    argv = ("--num-layers 12 --hidden-size 128 --num-attention-heads 4 --seq-length 64 --vocab-size 4096 "
            "--swiglu --ffn-hidden-size 512 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 64 "
            "--moe-shared-expert-intermediate-size 64 --moe-layer-freq ([0]*2+[1]*10) --mtp-num-layers 1 "
            "--pipeline-model-parallel-size 3 --pipeline-schedule dualpipev --dualpipe-layout auto "
            "--micro-batch-size 1 --global-batch-size 12").split()
    args = parser.parse_args(argv)
    args.world_size = 6  # before validation: data parallel 2 from world / (tp x pp x cp)
    assert model_shape(args) == replace(MOE_MTP, ffn=512, kv_channels=None)
    layout = auto_layout(args)
    assert layout == best_layout("dualpipev", 3, 6, LayerCosts.from_shape(MOE_MTP))[0]
    check_configuration("dualpipev", 3, 6, 12, layout, 1)
    args.data_parallel_size, args.kv_channels, args.num_query_groups = 2, 32, 4  # as validate_args sets them
    assert auto_layout(args) == layout
    args.vocab_size = None
    with pytest.raises(ScheduleError, match="needs --vocab-size"):
        auto_layout(args)
