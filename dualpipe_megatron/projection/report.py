"""The projection as a markdown table with its inputs and assumptions, or as JSON."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Sequence

from ..schedules.cli import markdown_table
from ..schedules.ir import ScheduleError
from ..schedules.model_shape import ModelShape
from .comm import Network
from .costs import StageTimes
from .count import ChunkCount
from .project import Projection
from .shapes import shape_to_json

GIB = 2**30

ASSUMPTIONS = [
    "Compute: per-op costs of a chunk are measured (`measure`: single-process, no "
    "communication; `calibrate`: compute kernels of a GPU profile) and "
    "scaled to the target shape by each op's FLOP ratio, i.e. the same achieved FLOP/s at "
    "both shapes; FLOPs count matrix products and attention only, causal attention as the half "
    "of the square under the mask (what causal flash kernels compute; schedules/model_shape.py).",
    "The measured layer is plain torch shaped like DeepSeek-V3's (MLA + MoE, 256 experts "
    "top-8, one shared); an EP rank's experts get a perfectly balanced load; rotary "
    "embedding is left out; the uniform placement also leaves out the embedding/output layers, "
    "the first dense layers and MTP.",
    "All-to-all: dispatch + combine per MoE layer each way; a token crosses the inter-node "
    "network once per remote node it routes to (at most nodes_per_token of the EP group's "
    "nodes, uniform) and NVLink for each of its top-k copies not on its landing GPU; the two "
    "links overlap, payloads are in the activation dtype (DeepSeek-V3's FP8 dispatch is not "
    "modelled). An op-cost file with measured all-to-all (calibrate) replaces this model; the "
    "model then only scales the measured ms to the target shape (its own ratio target / "
    "measured, so the link speeds cancel).",
    "Lone F and B pay their all-to-all in full; an F&B pair (DualPipe, DualPipeV, Megatron's "
    "combined 1F1B) costs max(compute, a2a) + loss x min(compute, a2a); W moves nothing.",
    "interleaved+a2a is Megatron's --overlap-moe-expert-parallel-comm order: one extra "
    "warm-up forward, then each steady-state F and B as one overlapped pair.",
    "p2p: hidden states of one micro-batch per stage boundary at p2p bandwidth plus latency, "
    "delaying the consumer only (asynchronous sends); every stage boundary between ranks is "
    "inter-node.",
    "Bubble = step time minus a rank's op time; exposed all-to-all counts as op time, so "
    "compare step times for its effect. tokens/s/GPU = M micro-batches' tokens / P / step: "
    "no optimizer step, no data-parallel gradient reduction, no batch-size ramp, balanced "
    "routing. Activations: saved tensors of our layer in bf16 (flash-style attention); "
    "activation recompute and FP8 activation caches (DeepSeek-V3 uses both) are left out, so "
    "the figure is an upper bound; params: one EP rank's share of the layers, no embeddings, "
    "no optimizer state.",
    "Budget rows ('dualpipev ... budget f', --budgets): DualPipeV's order from the op-order "
    "optimizer with every rank's peak of live (d,s,m) at most K = ceil(f x DeepSeek's order's "
    "largest per-rank peak), raised to the minimum any order needs; K counts stages (peak live "
    "column), the GiB column weighs each by its stage's saved bytes.",
]

REALISTIC = [
    "Realistic placement: the whole model layer by layer; each layer's F, B and W are one MoE "
    "layer's projected compute scaled by the FLOP ratio to a MoE layer (the same FLOP count, "
    "schedules/model_shape.py: dense layers, MLA, output layer + loss, MTP); all-to-all only on MoE layers "
    "(MTP's layer included). Each F&B pair is judged on its own: its compute C (its stages' "
    "compute times the measured F-then-B ratio) and its all-to-all A cost max(C, A) + overlap "
    "loss x min(C, A); the layout search and the op-order optimizer use the linear form "
    "C + loss x A, exact for every pair whose compute exceeds its all-to-all.",
    "Layouts: Megatron's schedules (1f1b, interleaved, zb1p) and zbv, vhalf, chimera, plain "
    "dualpipe(v) split as --account-for-embedding-in-pipeline-split "
    "--account-for-loss-in-pipeline-split does (embedding and loss one layer each; when the "
    "count does not divide, the middle stages take the extra layers); 'auto' rows use the "
    "layout search: Megatron's schedules over the layouts --pipeline-model-parallel-layout "
    "accepts, the loss alone in the last stage after the MTP layers' ('...|m|L') and the "
    "embedding alone in the first included (the loss's stage then also computes each MTP "
    "layer's output layer and loss, as Megatron's post-process does), dualpipe(v) over those "
    "our runtime accepts (the MTP layers with the loss in the last stage); '+opt' rows the "
    "op-order optimizer for the same stage costs.",
    "Activations: every transformer layer (dense, MoE, MTP) saves what a MoE layer saves, the "
    "output layer and each MTP head keep fp32 logits; params: every transformer layer as a MoE "
    "layer's EP share, embedding and output layer vocab x hidden each.",
]


def _ms(value: float) -> str:
    return f"{value:,.1f}"


def rows(results: list[Projection | ScheduleError], chunk: ChunkCount,
         tokens_per_gpu: float) -> list[dict[str, Any]]:
    """Figures per schedule; ``chunk`` is one 1/P stage of the target model, ``tokens_per_gpu``
    the tokens one step trains per pipeline GPU (M micro-batches' tokens / P)."""
    base = next((r.result.makespan for r in results
                 if isinstance(r, Projection) and r.variant.label == "1f1b"), None)
    out: list[dict[str, Any]] = []
    for r in results:
        if isinstance(r, ScheduleError):
            out.append({"schedule": None, "error": str(r)})
            continue
        res = r.result
        peak = r.peak_stage_activations
        out.append({
            "schedule": r.variant.label,
            "stages": res.schedule.stages,
            "step_ms": float(res.makespan),
            "tokens_per_s_per_gpu": tokens_per_gpu / (float(res.makespan) / 1e3),
            "vs_1f1b": float(res.makespan / base) if base else None,
            "bubble_ratio": float(res.bubble_ratio),
            "max_bubble_ms": float(res.max_bubble),
            "exposed_a2a_ms": r.exposed_a2a_ms,
            "peak_activations_stages": float(peak),
            "peak_activations_gib": float(peak) * chunk.saved_bytes / GIB,
            "peak_live_activations": r.peak_live,
            "max_activations": r.max_activations,
            "budget_clamped": r.clamped,
            "params_per_rank": float(r.params_stages) * chunk.params,
            "layout": r.layout,
        })
    return out


def _label(row: dict[str, Any]) -> str:
    """The schedule's name, with the budget it was optimized within (K live (d,s,m) per rank)."""
    if row["max_activations"] is None:
        return row["schedule"]
    raised = ", raised to the minimum" if row["budget_clamped"] else ""
    return f"{row['schedule']} (K={row['max_activations']}{raised})"


def markdown(table: list[dict[str, Any]]) -> str:
    header = ["schedule", "stages", "step (ms)", "tokens/s/GPU", "vs 1F1B", "bubble ratio",
              "max bubble (ms)", "exposed A2A (ms)", "peak live (d,s,m)", "peak act. (1/P stages)",
              "peak act. (GiB, no recompute, bf16)", "params/rank (B)"]
    lines = []
    for row in table:
        if row["schedule"] is None:
            lines.append(["n/a: " + row["error"]] + ["-"] * (len(header) - 1))
            continue
        lines.append([
            _label(row), str(row["stages"]), _ms(row["step_ms"]),
            f"{row['tokens_per_s_per_gpu']:,.0f}",
            f"{row['vs_1f1b']:.3f}" if row["vs_1f1b"] else "-",
            f"{row['bubble_ratio']:.3f}", _ms(row["max_bubble_ms"]),
            "-" if row["exposed_a2a_ms"] is None else _ms(row["exposed_a2a_ms"]),
            str(row["peak_live_activations"]), f"{row['peak_activations_stages']:.4g}",
            f"{row['peak_activations_gib']:.1f}", f"{row['params_per_rank'] / 1e9:.2f}",
        ])
    text = markdown_table(header, lines)
    layouts = [f"{row['schedule']}: {row['layout']}" for row in table if row.get("layout")]
    return text + ("\n\nLayouts (E embedding, t layer, m MTP, L output + loss; | between stages): "
                   + "; ".join(layouts) if layouts else "")


def inputs_text(target: ModelShape, times: StageTimes, net: Network, ranks: int,
                microbatches: int, chunks: Sequence[int], loss: float, placement: str) -> str:
    s = target
    return "\n".join([
        f"Job: P={ranks} pipeline ranks, EP={s.ep}, M={microbatches} micro-batches per step "
        f"(DualPipe: {microbatches // 2} per direction), interleaved with "
        f"{' and '.join(map(str, chunks))} chunks per rank; "
        f"one 1/P stage = {s.num_layers} MoE layers of hidden {s.hidden}, top-{s.topk} of "
        f"{s.experts} experts, {s.micro_batch}x{s.seq} tokens per micro-batch.",
        f"Placement: {placement}.",
        f"Compute per 1/P stage and micro-batch ({times.source}): F {_ms(times.F)} ms, "
        f"B {_ms(times.B)} ms, W {_ms(times.W)} ms, F-then-B {_ms(times.FB)} ms.",
        f"Communication per 1/P stage and micro-batch: all-to-all {_ms(times.a2a_fwd)} ms "
        f"forward + {_ms(times.a2a_bwd)} ms backward ({times.comm_source}); p2p "
        f"{times.p2p:.2f} ms per boundary. "
        f"Links: inter-node {net.ib_gbps:g} GB/s, NVLink {net.nvlink_gbps:g} GB/s, p2p "
        f"{net.p2p_gbps:g} GB/s + {net.p2p_latency_ms:g} ms, {net.gpus_per_node} GPUs/node, "
        f"tokens to <= {net.nodes_per_token} nodes, {net.dtype_bytes}-byte payloads; "
        f"F&B overlap loss {loss:g}.",
    ])


def assumptions(realistic: bool) -> list[str]:
    return ASSUMPTIONS + (REALISTIC if realistic else [])


def assumptions_text(realistic: bool = False) -> str:
    return "\n".join(f"- {a}" for a in assumptions(realistic))


def json_doc(target: ModelShape, times: StageTimes, net: Network, ranks: int,
             microbatches: int, chunks: Sequence[int], loss: float, table: list[dict[str, Any]],
             op_costs: str | None, placement: str) -> dict[str, Any]:
    return {
        "job": {"ranks": ranks, "microbatches": microbatches, "chunks": list(chunks),
                "stage_shape": shape_to_json(target), "placement": placement},
        "op_costs": op_costs or "built-in",
        "network": asdict(net),
        "overlap_loss": loss,
        "stage_ms": asdict(times),
        "rows": table,
        "assumptions": assumptions(placement.startswith("realistic")),
    }


__all__ = ["ASSUMPTIONS", "REALISTIC", "assumptions", "assumptions_text", "inputs_text", "json_doc", "markdown", "rows"]
