"""A Megatron-Core GPT (dense, or MoE with expert parallelism) run by Megatron's 1F1B and
interleaved schedules and by our DualPipeV and DualPipe, as benchmark variants.

Every variant holds the same weights (each parameter seeded by its global name), reads the
same micro-batches (per data-parallel rank) and differs only in schedule and placement. Each
initialises its own parallel state once; :class:`Variant` switches to it before every step.
Megatron's schedules get the p2p settings Megatron's training sets: batched p2p for 1F1B,
overlapped p2p for interleaved, pipeline outputs deallocated after sending.

A tuned DualPipeV: ``--dualpipe-layout auto``'s split and the op order optimized for measured
stage costs (``--dualpipe-optimize-order --dualpipe-stage-costs``). Megatron's 1F1B can count
the embedding and the loss as layers in its split (``--account-for-embedding-in-pipeline-split
--account-for-loss-in-pipeline-split``); :func:`accounting_effect` asks Megatron what that would
change here.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from busy_time import ComputeClock
from mcore_state import ParallelState
from variant import Variant, all_params

# Megatron's schedules and their virtual stages per rank (None: 1F1B without virtual stages).
MEGATRON_VPP = {"1f1b": None, "interleaved": 2, "interleaved-4": 4}
OUR_SCHEDULES = ("dualpipev", "dualpipe")
TUNED = "dualpipev-tuned"  # DualPipeV: auto layout, op order optimized for measured stage costs
ACCOUNTING = dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)


@dataclass(frozen=True)
class GPTShape:
    """Model and batch sizes; ``experts`` 0 is a dense model."""

    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    vocab: int
    experts: int = 0
    expert_ffn: int = 0
    topk: int = 2

    def moe_kwargs(self) -> dict[str, Any]:
        if not self.experts:
            return {}
        return dict(num_moe_experts=self.experts, moe_router_topk=self.topk, moe_ffn_hidden_size=self.expert_ffn,
                    moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2,
                    add_bias_linear=False)  # expert bias + probs: in-place-on-view error in 0.19.2


# The benchmarks' dense model (bench_megatron.py's defaults): 8 layers, hidden 256, 4 heads,
# sequence 128, micro-batches of 2 sequences, vocabulary 1024.
DENSE = GPTShape(layers=8, hidden=256, heads=4, seq=128, micro_batch=2, vocab=1024)


def _config(shape: GPTShape, pp: int, vpp: int | None, ep: int, **layout: Any):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        # As megatron.training sets them: overlapped p2p for interleaved, batched p2p otherwise.
        overlap_p2p_comm=vpp is not None, batch_p2p_comm=vpp is None, deallocate_pipeline_outputs=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        **shape.moe_kwargs(), **layout,
    )



def _gpt(config: Any, shape: GPTShape, pre: bool, post: bool, vp_stage: int | None) -> nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from dualpipe_megatron.megatron.model import global_param_name

    model = GPTModel(config, get_gpt_layer_local_spec(num_experts=shape.experts or None),
                     vocab_size=shape.vocab, max_sequence_length=shape.seq, pre_process=pre,
                     post_process=post, share_embeddings_and_output_weights=False, vp_stage=vp_stage)
    with torch.no_grad():
        for name, param in model.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(global_param_name(model, name).encode()))
            offset = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(0.02 * torch.randn(param.shape, generator=gen) + offset)
    return model


def _batches(shape: GPTShape, count: int) -> list[dict[str, torch.Tensor]]:
    """The step's micro-batches of this data-parallel rank."""
    from megatron.core import parallel_state as ps

    gen = torch.Generator().manual_seed(ps.get_data_parallel_rank())
    out = []
    for _ in range(count):
        tokens = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq + 1), generator=gen)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                    "position_ids": torch.arange(shape.seq).expand(shape.micro_batch, shape.seq)})
    return out


def _loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output.float().mean()
    return loss, {"lm loss": loss.detach()}


def _forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: nn.Module,
                  return_schedule_plan: bool = False):
    """Megatron's convention; with ``return_schedule_plan`` (our MoE F&B overlap) a schedule plan."""
    batch = next(data_iterator)
    args = (batch["tokens"], batch["position_ids"], None)
    if return_schedule_plan:
        return model.build_schedule_plan(*args, labels=batch["labels"]), _loss
    return model(*args, labels=batch["labels"]), _loss


def _stepper(forward_backward: Any, chunks: list[nn.Module], shape: GPTShape, m: int):
    batches = _batches(shape, m)

    def run() -> list:
        """One step; the loss reports (``forward_data_store``) on the last pipeline rank."""
        return forward_backward(forward_step_func=_forward_step, data_iterator=[iter(batches) for _ in chunks],
                                model=chunks, num_microbatches=m, seq_length=shape.seq,
                                micro_batch_size=shape.micro_batch)
    return run


def layers_per_rank(shape: GPTShape, pp: int, **split: Any) -> list[int]:
    """Decoder layers Megatron's 1F1B builds on each rank under ``split`` (its own function;
    raises as Megatron does for a split it refuses)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    config = _config(shape, pp, None, 1, **split)
    return [get_num_layers_to_build(config, pp_rank=r) for r in range(pp)]


def accounting_effect(shape: GPTShape, pp: int) -> str:
    """What counting the embedding and the loss as layers does to Megatron's 1F1B split here.

    Megatron splits ``layers + 2`` evenly and builds one layer less on the first and the last
    rank, so when ``layers`` splits evenly too (P divides both: P <= 2) the split is 1F1B's own,
    and otherwise Megatron refuses one of the two."""
    try:
        accounted = layers_per_rank(shape, pp, **ACCOUNTING)
    except (AssertionError, ValueError) as exc:
        return f"refused by Megatron: {' '.join(str(exc).split())}"
    if accounted == layers_per_rank(shape, pp):
        return f"the same split as 1F1B's ({accounted} decoder layers per rank)"
    return f"{accounted} decoder layers per rank, not measured"


def megatron_schedules(shape: GPTShape, pp: int) -> list[str]:
    """Megatron's schedules that can run this model: interleaving with ``v`` virtual stages
    needs whole layers in each of the ``pp * v`` stages."""
    return [s for s, vpp in MEGATRON_VPP.items() if vpp is None or shape.layers % (pp * vpp) == 0]


def flop_costs(shape: GPTShape) -> Any:
    """The FLOP model's per-layer costs of this GPT (what ``--dualpipe-layout auto`` uses)."""
    from dualpipe_megatron.schedules.layout import LayerCosts
    from dualpipe_megatron.schedules.model_shape import ModelShape

    return LayerCosts.from_shape(ModelShape(
        num_layers=shape.layers, hidden=shape.hidden, seq=shape.seq, vocab=shape.vocab, heads=shape.heads,
        micro_batch=shape.micro_batch, experts=shape.experts, topk=shape.topk, moe_ffn=shape.expert_ffn or None))


def megatron_variant(schedule: str, shape: GPTShape, pp: int, ep: int, m: int,
                     clock: ComputeClock | None) -> Variant:
    """Megatron's own 1F1B, or interleaved 1F1B with two or four virtual stages per rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    vpp = MEGATRON_VPP[schedule]
    state = ParallelState(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                          expert_model_parallel_size=ep)
    config = _config(shape, pp, vpp, ep)
    stages = [None] if vpp is None else list(range(vpp))
    chunks = [_gpt(config, shape, ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                   ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v), v) for v in stages]
    run = _stepper(get_forward_backward_func(), chunks, shape, m)
    return Variant(schedule, run, all_params(chunks), state.activate, clock=clock)


def our_variant(schedule: str, shape: GPTShape, pp: int, ep: int, m: int, trace_root: Path,
                name: str | None = None, layout: str | None = None, optimize_for: Any = None,
                max_activations: int | None = None) -> Variant:
    """Our DualPipeV or DualPipe through ``make_forward_backward_func``, traced for busy time;
    ``layout``, ``optimize_for`` and ``max_activations`` as ``--dualpipe-layout``,
    ``--dualpipe-optimize-order`` (with its stage costs) and ``--dualpipe-max-activations`` set them."""
    from megatron.core import parallel_state as ps

    from dualpipe_megatron.megatron.model import chunk_roles, embedding_ranks, model_config_kwargs, prepare_model
    from dualpipe_megatron.megatron.schedule import DualPipeOptions, make_forward_backward_func, stage_map_for

    state = ParallelState(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=2,
                          expert_model_parallel_size=ep, get_embedding_ranks=embedding_ranks)
    split = model_config_kwargs(schedule, pp, shape.layers, layout)["pipeline_model_parallel_layout"]
    config = _config(shape, pp, 2, ep, pipeline_model_parallel_layout=split)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    chunks = [_gpt(config, shape, r.pre_process, r.post_process, r.vp_stage)
              for r in chunk_roles(stage_map_for(schedule, pp), pp_rank)]
    name = name or schedule
    trace_dir = trace_root / name
    options = prepare_model(chunks, DualPipeOptions(schedule=schedule, timeout=300, trace_dir=str(trace_dir),
                                                    optimize_for=optimize_for, max_activations=max_activations),
                            pp_rank, pp)
    run = _stepper(make_forward_backward_func(options), chunks, shape, m)
    return Variant(name, run, all_params(chunks), state.activate, trace_dir=trace_dir)


def tuned_variant(shape: GPTShape, pp: int, ep: int, m: int, trace_root: Path) -> tuple[Variant, dict[str, Any]]:
    """DualPipeV with the auto layout and the op order optimized for the stage costs measured
    from the plain ``dualpipev`` variant's traced steps so far (all but the first), as
    ``trace costs`` then ``--dualpipe-stage-costs`` would; when the auto layout is not the even
    split those measurements do not apply and the FLOP model's stage costs are used instead.
    Collective; every rank reads the same trace files, so all optimize alike."""
    from dualpipe_megatron.schedules.layout import best_layout, even_counts, layout_string, stage_costs_for
    from dualpipe_megatron.schedules.optimize import optimize_order
    from dualpipe_megatron.schedules.registry import build_schedule
    from dualpipe_megatron.schedules.simulate import simulate
    from dualpipe_megatron.trace import load, pipelines
    from dualpipe_megatron.trace.analysis import kept_steps, measured_stage_costs

    layout = best_layout("dualpipev", pp, m, flop_costs(shape))[0]
    sched = build_schedule("dualpipev", pp, m)
    if layout == layout_string(even_counts(shape.layers, 2 * pp)):
        ranks = pipelines(load(trace_root / "dualpipev"))[0]
        costs, source = measured_stage_costs(ranks, kept_steps(ranks, 1)), "measured (plain dualpipev, ms)"
    else:
        counts = [stage.count("t") for stage in layout.split("|")]
        costs, source = stage_costs_for(sched, flop_costs(shape), counts), "FLOP model"
    variant = our_variant("dualpipev", shape, pp, ep, m, trace_root, TUNED, layout, costs)
    info = {"layout": layout, "stage_costs_from": source, "stage_costs": costs.to_json_obj(),
            "simulated_step": {"deepseek_order": float(simulate(sched, costs).makespan),
                               "optimized_order": float(simulate(optimize_order(sched, costs), costs).makespan)}}
    return variant, info


def build(schedules: list[str], shape: GPTShape, pp: int, ep: int, m: int, clock: ComputeClock,
          trace_root: Path) -> list[Variant]:
    """The variants in ``schedules`` order (collective: every rank builds the same list)."""
    out = []
    for schedule in schedules:
        if schedule in MEGATRON_VPP:
            out.append(megatron_variant(schedule, shape, pp, ep, m, clock))
        else:
            out.append(our_variant(schedule, shape, pp, ep, m, trace_root))
        dist.barrier()
    return out
