"""Rank process for tests/test_megatron_moe_overlap.py: DualPipeV's overlapped F&B on an MoE GPT
(4 experts, top-2, alltoall dispatcher, EP=2) x PP=2, bf16, 4 processes, against Megatron's own
interleaved 1F1B with its combined-1F1B EP overlap at the same sizes (PP=2, VPP=2, EP=2).

Run as ``python tests/moe_overlap_workers.py OUT_JSON`` with RANK, WORLD_SIZE=4, MASTER_ADDR and
MASTER_PORT set. Every layout starts from the same weights (each parameter seeded by its global
name, then cast to bf16); each data-parallel rank reads its own micro-batches. Gradients are
Megatron DDP's fp32 ``main_grad`` (local sums, no reduction), keyed by data-parallel rank and
global parameter name. Rank 0 writes one record per check, ``{check: {value name: value}}``
(JSON): what was measured, over every rank; the test file compares the values.
"""

from __future__ import annotations

import sys
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from dualpipe_megatron.megatron.cpu_compat import install_cpu_compat
from dualpipe_megatron.megatron.model import global_param_name
from megatron_workers import Records, _per_rank, publish

VOCAB, SEQ, MBS, HIDDEN, HEADS, LAYERS, PP, EP = 64, 8, 2, 16, 2, 8, 2, 2

Result = tuple[dict[str, list[float]], dict[str, torch.Tensor]]  # losses by dp rank, grads by key


def _config(layout=None, megatron_overlap: bool = False, delay_wgrad: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32,  # built in fp32 and cast, as Megatron's Float16Module does
        bf16=True, pipeline_dtype=torch.bfloat16,
        pipeline_model_parallel_size=PP, virtual_pipeline_model_parallel_size=2,
        pipeline_model_parallel_layout=layout,
        batch_p2p_comm=False,  # PP=2 with VPP: batched p2p swaps equal-shaped tensors
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        expert_model_parallel_size=EP, num_moe_experts=4, moe_router_topk=2,
        moe_token_dispatcher_type="alltoall", moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2,
        add_bias_linear=False,  # expert bias + probs hits an in-place-on-view error in 0.19.2
        # Megatron validates its EP-overlap requirements (bf16, EP > 1, alltoall, VP set) here.
        overlap_moe_expert_parallel_comm=megatron_overlap,
        # Megatron's delayed wgrad: plan slots call backward_dw (a no-op on local linears).
        delay_wgrad_compute=delay_wgrad,
    )
    # A loss scale, as a mixed-precision optimizer sets one (a power of two: exact in bf16). Our
    # plain path applies it in the forward, Megatron's and our overlapped path in the backward.
    config.grad_scale_func = _scale_loss
    return config


def _scale_loss(loss: torch.Tensor) -> torch.Tensor:
    return loss * 4.0


def _parallel(ours: bool) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from dualpipe_megatron.megatron.model import embedding_ranks

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=PP, virtual_pipeline_model_parallel_size=2,
                                 expert_model_parallel_size=EP,
                                 get_embedding_ranks=embedding_ranks if ours else None)
    model_parallel_cuda_manual_seed(1234)


def _gpt(config, pre: bool, post: bool, vp_stage: int) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(config, get_gpt_layer_local_spec(num_experts=4), vocab_size=VOCAB,
                     max_sequence_length=SEQ, pre_process=pre, post_process=post,
                     share_embeddings_and_output_weights=False, vp_stage=vp_stage)
    for name, param in model.named_parameters():
        gen = torch.Generator().manual_seed(zlib.crc32(global_param_name(model, name).encode()))
        value = 0.1 * torch.randn(param.shape, generator=gen)
        param.data.copy_(value + 1.0 if name.endswith("norm.weight") else value)
    return model.bfloat16()


def _wrap(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    wrapped = [DistributedDataParallel(c.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), c,
                                       disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    for w in wrapped:
        w.zero_grad_buffer()
    return wrapped


def _batches(m: int) -> list[dict[str, torch.Tensor]]:
    from megatron.core import parallel_state as ps

    gen = torch.Generator().manual_seed(1000 * m + ps.get_data_parallel_rank())
    out = []
    for _ in range(m):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                    "position_ids": torch.arange(SEQ).expand(MBS, SEQ)})
    return out


def _loss(output: torch.Tensor):
    loss = output.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron's convention: with return_schedule_plan, a schedule plan instead of the output."""
    batch = next(data_iterator)
    args = (batch["tokens"], batch["position_ids"], None)
    if return_schedule_plan:
        return model.build_schedule_plan(*args, labels=batch["labels"]), _loss
    return model(*args, labels=batch["labels"]), _loss


def _collect(chunks, wrapped, reports) -> Result:
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_rank()
    grads = {}
    for model in chunks:
        for name, p in model.named_parameters():
            grads[f"dp{dp}:{global_param_name(model, name)}"] = p.main_grad.detach().clone()
    losses = {f"dp{dp}": [float(r["lm loss"]) for r in reports]} if reports else {}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (losses, grads))
    all_losses, all_grads = {}, {}
    for part_losses, part_grads in gathered:
        all_losses |= part_losses
        all_grads |= part_grads
    return all_losses, all_grads


def run_megatron(m: int, overlap: bool, delay_wgrad: bool = False) -> Result:
    """Megatron's interleaved 1F1B (with overlap: its combined-1F1B EP overlap)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _parallel(ours=False)
    config = _config(megatron_overlap=overlap, delay_wgrad=delay_wgrad)
    chunks = [_gpt(config, ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                   ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v), v) for v in range(2)]
    wrapped = _wrap(chunks)
    batches = _batches(m)
    reports = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=[iter(batches) for _ in wrapped], model=wrapped,
        num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS)
    return _collect(chunks, wrapped, reports)


def run_ours(m: int, overlap: bool, counter: list[int], delay_wgrad: bool = False) -> Result:
    from dualpipe_megatron.megatron.model import chunk_roles, model_config_kwargs, prepare_model
    from dualpipe_megatron.megatron.schedule import DualPipeOptions, make_forward_backward_func, stage_map_for

    _parallel(ours=True)
    layout = model_config_kwargs("dualpipev", PP, LAYERS)["pipeline_model_parallel_layout"]
    # Validated with Megatron's EP-overlap flag (its requirements hold). The flag only selects
    # Megatron's combined-1F1B schedule; ours is DualPipeOptions.moe_overlap, so it is cleared,
    # except with delayed wgrad, which Megatron allows only with it (our schedule accepts it).
    config = _config(layout, megatron_overlap=True, delay_wgrad=delay_wgrad)
    config.overlap_moe_expert_parallel_comm = delay_wgrad
    from megatron.core import parallel_state as ps

    pp_rank = ps.get_pipeline_model_parallel_rank()
    chunks = [_gpt(config, r.pre_process, r.post_process, r.vp_stage)
              for r in chunk_roles(stage_map_for("dualpipev", PP), pp_rank)]
    options = prepare_model(chunks, DualPipeOptions(schedule="dualpipev", timeout=120, moe_overlap=overlap),
                            pp_rank, PP)
    wrapped = _wrap(chunks)
    batches = _batches(m)
    reports = make_forward_backward_func(options)(
        forward_step_func=_forward_step, data_iterator=[iter(batches) for _ in wrapped], model=wrapped,
        num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS)
    counter.append(options.last_stats.deferred)
    return _collect(chunks, wrapped, reports)


def _compare(name: str, ref: Result, got: Result) -> Records:
    """Losses and every grad (both already gathered from every rank) against the reference: how
    many losses each data-parallel rank reported, the worst relative diffs (per tensor, relative
    to its largest reference value), and the grads only one side has."""
    (ref_losses, ref_grads), (losses, grads) = ref, got
    worst_loss = max((abs(a - b) / max(abs(a), 1e-30) for key in ref_losses
                      for a, b in zip(ref_losses[key], losses.get(key, []))), default=0.0)
    diffs = {key: float((ref_grads[key] - grads[key]).abs().max()) for key in set(grads) & set(ref_grads)}
    rel = [d / max(float(ref_grads[key].abs().max()), 1e-30) for key, d in diffs.items()]
    return {name: {
        "losses": {key: len(v) for key, v in sorted(losses.items())},
        "reference_losses": {key: len(v) for key, v in sorted(ref_losses.items())},
        "worst_loss_rel_diff": worst_loss,
        "worst_grad_rel_diff": max(rel, default=0.0),
        "grads_only_run": sorted(set(grads) - set(ref_grads)),
        "grads_only_reference": sorted(set(ref_grads) - set(grads)),
        "grads": len(grads),
        "nonzero_grads": sum(1 for g in grads.values() if float(g.abs().max()) > 0),
        "bitwise_equal_grads": sum(d == 0.0 for d in diffs.values()),
    }}


def main(out_path: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    install_cpu_compat()
    from dualpipe_megatron.megatron import moe_overlap

    calls = {"fb": 0, "f": 0}
    pair = moe_overlap.MoEOverlapHandlers.pair
    lone = moe_overlap.MoEOverlapHandlers.forward

    def counting_pair(self, *args, **kwargs):
        calls["fb"] += 1
        return pair(self, *args, **kwargs)

    def counting_forward(self, *args, **kwargs):
        calls["f"] += 1
        return lone(self, *args, **kwargs)

    moe_overlap.MoEOverlapHandlers.pair = counting_pair
    moe_overlap.MoEOverlapHandlers.forward = counting_forward

    results: Records = {}
    for m in (4, 6):
        megatron_overlap = run_megatron(m, overlap=True)
        megatron_plain = run_megatron(m, overlap=False)
        deferred: list[int] = []
        calls.update(fb=0, f=0)
        on = run_ours(m, overlap=True, counter=deferred)
        fb_on, f_on = calls["fb"], calls["f"]
        calls.update(fb=0, f=0)
        off = run_ours(m, overlap=False, counter=deferred)
        fb_off = calls["fb"] + calls["f"]
        counts = _per_rank((fb_on, f_on, fb_off, deferred))
        results |= _compare(f"overlap_on_vs_megatron_combined_1f1b_m{m}", megatron_overlap, on)
        results |= _compare(f"overlap_off_vs_megatron_1f1b_m{m}", megatron_plain, off)
        results |= _compare(f"overlap_on_vs_off_m{m}", off, on)
        results |= _compare(f"megatron_combined_vs_plain_1f1b_m{m}", megatron_plain, megatron_overlap)
        results[f"overlap_ran_m{m}"] = {
            "overlapped_fb_ops_per_rank": [c[0] for c in counts],
            "plan_built_lone_forwards_per_rank": [c[1] for c in counts],
            "plan_built_ops_overlap_off_per_rank": [c[2] for c in counts],
            "deferred_closures_on_off_per_rank": [c[3] for c in counts],
        }
    # Megatron's delayed wgrad (--delay-wgrad-compute): each plan slot's backward_dw moves to W.
    deferred = []
    reference = run_megatron(4, overlap=True, delay_wgrad=True)
    delayed = run_ours(4, overlap=True, counter=deferred, delay_wgrad=True)
    plain = run_ours(4, overlap=True, counter=deferred)
    results |= _compare("delayed_wgrad_vs_megatron_combined_1f1b_m4", reference, delayed)
    results |= _compare("delayed_wgrad_vs_without_m4", plain, delayed)
    results["delayed_wgrad_slots_deferred"] = {"deferred_closures_with_without_per_rank": _per_rank(deferred)}
    publish(out_path, results)


if __name__ == "__main__":
    main(sys.argv[1])
