"""``python -m dualpipe_megatron.schedules layout``: the ``--dualpipe-layout`` with the shortest
simulated step, from the model's shape (a FLOP model) or a file of per-layer costs."""

from __future__ import annotations

import argparse
import json
from fractions import Fraction
from pathlib import Path

from .ir import ScheduleError
from .layout import (SCHEDULES, LayerCosts, best_layout, even_counts, layout_string,
                     parse_moe_layer_freq, stage_costs_for)
from .model_shape import ModelShape
from .registry import build_schedule
from .simulate import StageCosts, simulate

# Model flags, named as Megatron's: (flag, ModelShape field, type, help).
_MODEL = (
    ("--hidden-size", "hidden", int, "hidden size (required without --layer-costs)"),
    ("--seq-length", "seq", int, "tokens per sequence (required without --layer-costs)"),
    ("--vocab-size", "vocab", int, "vocabulary size, padded (required without --layer-costs)"),
    ("--ffn-hidden-size", "ffn", int, "dense MLP width (default 4 x hidden)"),
    ("--num-attention-heads", "heads", int,
     "attention heads (default 1; matters with --num-query-groups or --multi-latent-attention)"),
    ("--kv-channels", "kv_channels", int, "per-head width (default hidden / heads)"),
    ("--num-query-groups", "query_groups", int, "key/value heads (grouped-query attention)"),
    ("--micro-batch-size", "micro_batch", int, "sequences per micro-batch (default 1)"),
    ("--num-experts", "experts", int, "routed experts: MoE layers (default: dense)"),
    ("--moe-router-topk", "topk", int, "experts per token (default 2)"),
    ("--moe-ffn-hidden-size", "moe_ffn", int, "routed expert width (default --ffn-hidden-size)"),
    ("--moe-shared-expert-intermediate-size", "shared_ffn", int, "shared experts' total width"),
    ("--moe-layer-freq", "moe_layer_freq", str,
     "N (every N-th layer is MoE, default 1) or a list such as '([0]*3+[1]*58)'"),
    ("--mtp-num-layers", "mtp_layers", int, "MTP layers, with the loss"),
    ("--q-lora-rank", "q_lora_rank", int, "MLA query compression (default none)"),
    ("--kv-lora-rank", "kv_lora_rank", int, "MLA key/value compression (default 32)"),
    ("--qk-head-dim", "qk_head_dim", int, "MLA query/key head width (default 128)"),
    ("--qk-pos-emb-head-dim", "qk_pos_dim", int, "MLA rotary head width (default 64)"),
    ("--v-head-dim", "v_head_dim", int, "MLA value head width (default 128)"),
)
_SWITCHES = (("--swiglu", "gated", "gated MLPs and experts (SwiGLU)"),
             ("--multi-latent-attention", "mla", "multi-head latent attention (MLA)"))


def add_layout_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("layout", help="layers per stage (--dualpipe-layout) with the shortest simulated step",
                       description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--schedule", required=True, help=f"one of: {', '.join(SCHEDULES)}")
    p.add_argument("--ranks", "-P", type=int, required=True, help="pipeline ranks P")
    p.add_argument("--microbatches", "-M", type=int, required=True, help="micro-batches per step")
    p.add_argument("--num-layers", type=int, default=None,
                   help="decoder layers (required without --layer-costs)")
    for flag, dest, kind, text in _MODEL:
        p.add_argument(flag, dest=dest, type=kind, default=None, help=text,
                       metavar="PATTERN" if kind is str else "N")
    for flag, dest, text in _SWITCHES:
        p.add_argument(flag, dest=dest, action="store_true", help=text)
    p.add_argument("--layer-costs", metavar="FILE", default=None,
                   help='per-layer costs instead of the FLOP model: JSON {"embedding": {"F", "B", "W"}, '
                        '"decoder": [{"F", "B", "W"}, ...], "mtp": [...], "loss": {"F", "B", "W"}} '
                        "(one micro-batch, any unit; loss = output layer + loss)")
    p.add_argument("--fb-ratio", default="1", help="an overlapped F&B pair costs this x (F + B) (default 1)")
    p.add_argument("--c", default="0", help="p2p latency between ranks, in the costs' unit (default 0)")
    p.set_defaults(func=cmd_layout)


def _layer_costs(args: argparse.Namespace) -> tuple[LayerCosts, str]:
    given = [flag for flag, dest, *_ in (*_MODEL, *_SWITCHES) if getattr(args, dest) not in (None, False)]
    if args.layer_costs:
        if given:
            raise ScheduleError(f"--layer-costs replaces the model flags; drop {', '.join(given)}")
        try:
            costs = LayerCosts.from_json_obj(json.loads(Path(args.layer_costs).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ScheduleError(f"cannot read layer costs {args.layer_costs}: {exc}") from None
        if args.num_layers not in (None, costs.num_layers):
            raise ScheduleError(f"{args.layer_costs} has {costs.num_layers} decoder layers, not --num-layers "
                                f"{args.num_layers}")
        return costs, f"costs from {args.layer_costs}"
    missing = [flag for flag, dest in (("--num-layers", "num_layers"), ("--hidden-size", "hidden"),
                                       ("--seq-length", "seq"), ("--vocab-size", "vocab"))
               if getattr(args, dest) is None]
    if missing:
        raise ScheduleError(f"the FLOP model needs {', '.join(missing)} (or pass --layer-costs FILE)")
    fields = {dest: getattr(args, dest) for _, dest, *_ in (*_MODEL, *_SWITCHES) if getattr(args, dest) is not None}
    if args.moe_layer_freq is not None:
        fields["moe_layer_freq"] = parse_moe_layer_freq(args.moe_layer_freq)
    return LayerCosts.from_shape(ModelShape(num_layers=args.num_layers, **fields)), "FLOPs (FLOP model)"


def _num(value: Fraction) -> str:
    return f"{float(value):.4g}"


def _stage_rows(sched_ranks: dict[int, list[int]], layout: str, costs: StageCosts) -> list[list[str]]:
    rows, first = [], 0
    for s, part in enumerate(layout.split("|")):
        n = part.count("t")
        cost = costs.stages[(0, s)]
        layers = f"{first}-{first + n - 1}" if n > 1 else (str(first) if n else "-")
        rows.append([str(s), "/".join(map(str, sched_ranks[s])), part, layers, _num(cost.F), _num(cost.F + cost.B)])
        first += n
    return rows


def cmd_layout(args: argparse.Namespace) -> None:
    layer_costs, unit = _layer_costs(args)
    layout, costs, step = best_layout(args.schedule, args.ranks, args.microbatches, layer_costs,
                                      args.fb_ratio, args.c)
    sched = build_schedule(args.schedule, args.ranks, args.microbatches)
    even = even_counts(layer_costs.num_layers, sched.stages)
    even_step = simulate(sched, stage_costs_for(sched, layer_costs, even, costs.fb_ratio, costs.c)).makespan
    ranks: dict[int, list[int]] = {}
    for (d, s), r in sorted(sched.placement.items()):
        ranks.setdefault(s, []).append(r)
    print(layout)
    print(f"{sched.name}: P={sched.ranks} M={sched.microbatches}, {unit} per micro-batch, F&B ratio "
          f"{_num(costs.fb_ratio)}, c={_num(costs.c)}")
    header = ["stage", "rank" if sched.directions == 1 else "ranks (d0/d1)", "layout", "decoder layers", "F", "F+B"]
    for row in (header, ["---"] * len(header), *_stage_rows(ranks, layout, costs)):
        print("| " + " | ".join(row) + " |")
    what = "even split" if layer_costs.num_layers % sched.stages == 0 else "most even split"
    print(f"simulated step: {_num(step)}; {what} {layout_string(even, len(layer_costs.mtp))}: {_num(even_step)} "
          f"({float(step / even_step - 1):+.1%})")


__all__ = ["add_layout_parser", "cmd_layout"]
