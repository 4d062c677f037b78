"""Rank process for tests/test_megatron_cpu.py: Megatron's own schedules on CPU/gloo.

Run as ``python tests/megatron_workers.py OUT_JSON`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (world size 2). One launch runs every layout in turn (importing Megatron costs
seconds per process), re-initialising model parallelism in between. Rank 0 writes one record per
check, ``{check: {value name: value}}`` (JSON), to OUT_JSON: what was measured, over every rank;
the test file compares the values.

Every layout starts from the same weights: each parameter is filled from a generator seeded
by its *global* name (layer number and expert index made global), so a PP stage or an EP rank
holds exactly the slice of the PP=1 / EP=1 model it owns.
"""

from __future__ import annotations

import json
import sys
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from dualpipe_megatron.megatron.cpu_compat import install_cpu_compat
from dualpipe_megatron.megatron.model import global_param_name

VOCAB, SEQ, MBS, HIDDEN, HEADS = 64, 8, 2, 16, 2
MICROBATCHES = 4
LR, CLIP = 1e-2, 0.1

Result = tuple[list[torch.Tensor], dict[str, torch.Tensor]]  # (losses, grads by global name)
Records = dict[str, dict[str, object]]  # {check: {value name: JSON value}}


def _config(num_layers: int, pp: int, vpp: int | None, **moe: object):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        # Batched p2p between the same two ranks in both directions matches ops by posting
        # order and swaps equal-shaped tensors at PP=2 with VPP (see megatron_cpu.md).
        batch_p2p_comm=vpp is None,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **moe,
    )



def _build(num_layers: int, pp: int, vpp: int | None, **moe: object) -> list[torch.nn.Module]:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _config(num_layers, pp, vpp, **moe)
    spec = get_gpt_layer_local_spec(num_experts=moe.get("num_moe_experts"))
    chunks = []
    for vp in range(vpp or 1):
        stage = vp if vpp else None
        model = GPTModel(
            config,
            spec,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=False,
            vp_stage=stage,
        )
        for name, param in model.named_parameters():
            gname = global_param_name(model, name)
            gen = torch.Generator().manual_seed(zlib.crc32(gname.encode()))
            value = 0.1 * torch.randn(param.shape, generator=gen)
            param.data.copy_(value + 1.0 if name.endswith("norm.weight") else value)
        chunks.append(model)
    return chunks


def _batches(seed: int, count: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen)
        out.append(
            {
                "tokens": tokens[:, :-1],
                "labels": tokens[:, 1:],
                "position_ids": torch.arange(SEQ).expand(MBS, SEQ),
            }
        )
    return out


def _loss(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, _loss


@contextmanager
def _parallel(pp: int = 1, vpp: int | None = None, ep: int = 1) -> Iterator[None]:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
    )
    try:
        model_parallel_cuda_manual_seed(1234)
        yield
    finally:
        ps.destroy_model_parallel()


def _train_step(chunks: list[torch.nn.Module], data_seed: int) -> list[torch.Tensor]:
    """Forward and backward of MICROBATCHES micro-batches with Megatron's schedule."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = _batches(data_seed, MICROBATCHES)
    forward_backward = get_forward_backward_func()  # after init: it reads the PP size
    reports = forward_backward(
        forward_step_func=_forward_step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )
    return [r["lm loss"] for r in reports] if reports else []


def _named(chunks: list[torch.nn.Module], attr: str) -> dict[str, torch.Tensor]:
    """`param.<attr>` of every parameter, keyed by global name."""
    return {
        global_param_name(m, n): getattr(p, attr).detach().clone()
        for m in chunks
        for n, p in m.named_parameters()
    }


def _run(
    pp: int, vpp: int | None, ep: int, num_layers: int, data_seed: int, **moe: object
) -> Result:
    """One forward/backward of this layout: (losses, grads by global name)."""
    with _parallel(pp, vpp, ep):
        chunks = _build(num_layers, pp, vpp, **moe)
        losses = _train_step(chunks, data_seed)
        return losses, _named(chunks, "grad")


def _max_diff(a: torch.Tensor | None, b: torch.Tensor) -> float:
    if a is None or a.shape != b.shape:
        return float("inf")
    return 0.0 if torch.equal(a, b) else float((a - b).abs().max())


def _per_rank(value: object) -> list:
    """Every rank's ``value``, in rank order (collective: all ranks call it)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _compare(name: str, ref: Result, got: Result) -> Records:
    """This rank's losses and grads against the reference, over every rank: the losses each rank
    holds, the worst absolute max diffs, the grads that are not all zero, the parameters no rank
    holds."""
    (ref_losses, ref_grads), (losses, grads) = ref, got
    loss_diff = max((_max_diff(a, b) for a, b in zip(ref_losses, losses)), default=0.0)
    grad_diffs = [_max_diff(ref_grads.get(n), g) for n, g in grads.items()]
    held = _per_rank((sorted(grads), len(losses), len(ref_losses), loss_diff, max(grad_diffs, default=0.0),
                      sum(1 for g in grads.values() if g.any()), sum(d == 0.0 for d in grad_diffs)))
    return {name: {
        "losses_per_rank": [h[1] for h in held],
        "reference_losses_per_rank": [h[2] for h in held],
        "worst_loss_abs_diff": max(h[3] for h in held),
        "worst_grad_abs_diff": max(h[4] for h in held),
        "grads_per_rank": [len(h[0]) for h in held],
        "nonzero_grads_per_rank": [h[5] for h in held],
        "bitwise_equal_grads": sum(h[6] for h in held),
        "missing_parameters": sorted(set(ref_grads) - {n for h in held for n in h[0]}),
    }}


def rng_checks() -> Records:
    """Megatron's RNG tracker must really switch generator state on CPU (dropout in TP regions
    and expert init depend on it), not silently fork nothing."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    with _parallel():
        tracker = get_cuda_rng_tracker()
        torch.manual_seed(5)
        plain = torch.rand(4)
        torch.manual_seed(5)
        with tracker.fork():
            first = torch.rand(4)
        outside = torch.rand(4)
        with tracker.fork():
            second = torch.rand(4)
    draws = {"plain": plain.tolist(), "first_fork": first.tolist(), "after_fork": outside.tolist(),
             "second_fork": second.tolist()}
    return {"rng_fork": {"draws_per_rank": _per_rank(draws)}}


def dense_checks() -> Records:
    # PP=1 runs on both ranks (DP=2 without grad sync): each rank holds the full reference.
    ref = _run(pp=1, vpp=None, ep=1, num_layers=4, data_seed=7)
    results = _compare("pp2_1f1b", ref, _run(pp=2, vpp=None, ep=1, num_layers=4, data_seed=7))
    results |= _compare("pp2_vpp2", ref, _run(pp=2, vpp=2, ep=1, num_layers=4, data_seed=7))
    return results


def moe_checks() -> Records:
    moe = dict(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        moe_ffn_hidden_size=32,
        moe_aux_loss_coeff=1e-2,
        add_bias_linear=False,  # expert bias + probs hits an in-place-on-view error in 0.19.2
    )
    seed = 11 + dist.get_rank()  # different tokens per rank, so EP=2 really exchanges tokens
    ref_losses, ref_grads = _run(pp=1, vpp=None, ep=1, num_layers=2, data_seed=seed, **moe)
    # At EP=1 each rank's experts saw only its own tokens; at EP=2 an expert sees both ranks'.
    for name, grad in ref_grads.items():
        if ".local_experts." in name:
            dist.all_reduce(grad)
    got = _run(pp=1, vpp=None, ep=2, num_layers=2, data_seed=seed, **moe)
    return _compare("moe_ep2", (ref_losses, ref_grads), got)


def optimizer_checks() -> Records:
    """DP=2 Megatron DDP (overlapped grad reduce) + distributed optimizer, one clipped Adam step,
    against plain torch: averaged grads, clipped by total norm, `torch.optim.Adam`."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    seed = 21 + dist.get_rank()
    _, grads = _run(pp=1, vpp=None, ep=1, num_layers=2, data_seed=seed)
    with _parallel():
        params = _named(_build(2, 1, None), "data")
    for grad in grads.values():
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
    ref_norm = float(torch.stack([g.norm() for g in grads.values()]).norm())
    scale = min(1.0, CLIP / (ref_norm + 1e-6))
    ref = {n: p.clone().requires_grad_() for n, p in params.items()}
    for n, p in ref.items():
        p.grad = grads[n] * scale
    torch.optim.Adam(ref.values(), lr=LR).step()

    with _parallel():
        (module,) = _build(2, 1, None)
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=2000
        )
        model = DistributedDataParallel(module.config, ddp_config, module)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=LR,
            weight_decay=0.0,
            clip_grad=CLIP,
            use_distributed_optimizer=True,
        )
        optimizer = get_megatron_optimizer(opt_config, [model])
        module.config.no_sync_func = model.no_sync
        module.config.finalize_model_grads_func = finalize_model_grads
        model.zero_grad_buffer()
        optimizer.zero_grad()
        _train_step([model], seed)
        success, norm, _ = optimizer.step()
        got = _named([module], "data")
    expected = {n: p.detach() for n, p in ref.items()}
    worst = max(float((expected[n] - got[n]).abs().max()) for n in got)
    moved = min(float((expected[n] - params[n]).abs().max()) for n in got)
    return {"ddp_distopt": {
        "step_succeeded_per_rank": _per_rank(bool(success)),
        "grad_norm_per_rank": _per_rank(float(norm)),
        "torch_grad_norm_per_rank": _per_rank(ref_norm),
        "worst_param_abs_diff": max(_per_rank(worst)),
        "smallest_param_update": min(_per_rank(moved)),
    }}


def main(out_path: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    results: Records = {"installed": {"groups_per_rank": _per_rank(list(install_cpu_compat()))}}
    results |= rng_checks()
    results |= dense_checks()
    results |= moe_checks()
    results |= optimizer_checks()
    publish(out_path, results)


def publish(out_path: str, results: Records) -> None:
    """Rank 0 writes the records for the launching test; then every rank leaves together."""
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
