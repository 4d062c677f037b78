"""Rank process for tests/test_megatron_dualpipe.py: our DualPipe/DualPipeV forward_backward_func
on Megatron GPTModel chunks, against Megatron's own 1F1B and a PP=1 run.

Run as ``python tests/megatron_dualpipe_workers.py OUT_JSON`` with RANK, WORLD_SIZE (the
pipeline size P), MASTER_ADDR and MASTER_PORT set. Every layout starts from the same weights
(each parameter seeded by its global name, see megatron_workers.py). Rank 0 writes one record
per check, ``{check: {value name: value}}`` (JSON): what was measured, over every rank; the test
file compares the values.
"""

from __future__ import annotations

import random
import sys
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from dualpipe_megatron.megatron.cpu_compat import install_cpu_compat
from dualpipe_megatron.megatron.model import global_param_name
from megatron_workers import Records, _batches, _config, _forward_step, _max_diff, _per_rank, publish

VOCAB, SEQ, HIDDEN = 64, 8, 16
TOLERANCE = 1e-6  # relative to the largest reference value, per tensor
Result = tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]  # losses, grads by global name


def _parallel(pp: int, vpp: int | None, tied_local: bool) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from dualpipe_megatron.megatron.model import embedding_ranks

    ps.destroy_model_parallel()
    _release_groups()
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        get_embedding_ranks=embedding_ranks if tied_local else None,
    )
    model_parallel_cuda_manual_seed(1234)


def _release_groups() -> None:
    """Destroy the previous layout's process groups. Megatron's destroy_model_parallel only forgets
    them, and each gloo group keeps its own threads: over this worker's dozens of layouts, 4 ranks
    reached tens of thousands of threads, past the machine's pid limit."""
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        if group is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)


def _fill(model: torch.nn.Module, tied: bool) -> None:
    """Weights from a generator seeded by the global name; a tied output copy is the embedding."""
    for name, param in model.named_parameters():
        gname = global_param_name(model, name)
        if tied and gname == "output_layer.weight":
            gname = "embedding.word_embeddings.weight"
        gen = torch.Generator().manual_seed(zlib.crc32(gname.encode()))
        value = 0.1 * torch.randn(param.shape, generator=gen)
        param.data.copy_(value + 1.0 if name.endswith("norm.weight") else value)


def _gpt(config, pre: bool, post: bool, tied: bool, vp_stage: int | None) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                     pre_process=pre, post_process=post, share_embeddings_and_output_weights=tied,
                     vp_stage=vp_stage)
    _fill(model, tied)
    return model


def _megatron_layout(layers: int, pp: int, tied: bool, **extra: object) -> list[torch.nn.Module]:
    """Megatron's own placement (PP=1 or 1F1B), and its forward_backward_func."""
    from megatron.core import parallel_state as ps

    _parallel(pp, None, tied_local=False)
    config = _config(layers, pp, None, **extra)
    return [_gpt(config, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(), tied, None)]


def _our_layout(schedule: str, layers: int, pp: int, tied: bool, **extra: object):
    from dualpipe_megatron.megatron.model import chunk_roles, model_config_kwargs, prepare_model
    from dualpipe_megatron.megatron.schedule import DualPipeOptions, stage_map_for

    _parallel(pp, 2, tied_local=True)
    kwargs = model_config_kwargs(schedule, pp, layers)
    config = _config(layers, pp, 2, pipeline_model_parallel_layout=kwargs["pipeline_model_parallel_layout"],
                     **extra)
    rank = dist.get_rank()
    chunks = [_gpt(config, r.pre_process, r.post_process, tied, r.vp_stage)
              for r in chunk_roles(stage_map_for(schedule, pp), rank)]
    options = prepare_model(chunks, DualPipeOptions(schedule=schedule, timeout=120), rank, pp)
    return chunks, options


def _step(chunks: list[torch.nn.Module], fb, m: int, seed: int, forward_only: bool = False) -> list[torch.Tensor]:
    batches = _batches(seed, m)
    reports = fb(forward_step_func=_forward_step, data_iterator=[iter(batches) for _ in chunks],
                 model=chunks, num_microbatches=m, seq_length=SEQ, micro_batch_size=batches[0]["tokens"].shape[0],
                 forward_only=forward_only)
    return [r["lm loss"] for r in reports] if reports else []


def _grads(chunks: list[torch.nn.Module], tied: bool) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    for model in chunks:
        for name, p in model.named_parameters():
            gname = global_param_name(model, name)
            if tied and gname == "output_layer.weight":
                gname = "embedding.word_embeddings.weight"
            out.setdefault(gname, []).append(p.grad.detach().clone())
    return out


def _sum_megatron_tie(grads: dict[str, list[torch.Tensor]], tied: bool, pp: int) -> None:
    """What Megatron's finalize does for a tie across first and last rank: sum both copies."""
    if not tied or pp == 1:
        return
    name = "embedding.word_embeddings.weight"
    mine = grads.get(name, [torch.zeros(VOCAB, HIDDEN)])[0]
    total = mine.clone()
    dist.all_reduce(total)
    if name in grads:
        grads[name] = [total]


def _run_megatron(pp: int, layers: int, m: int, seed: int, tied: bool, forward_only: bool = False) -> Result:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = _megatron_layout(layers, pp, tied)
    losses = _step(chunks, get_forward_backward_func(), m, seed, forward_only)
    if forward_only:
        return losses, {}
    grads = _grads(chunks, tied)
    _sum_megatron_tie(grads, tied, pp)
    return losses, _union(grads)


def _union(grads: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """Every rank's reference grads, so any placement can look up any parameter."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, grads)
    out: dict[str, list[torch.Tensor]] = {}
    for part in gathered:
        for name, copies in part.items():
            out.setdefault(name, copies)
    return out


def _run_ours(schedule: str, layers: int, m: int, seed: int, tied: bool, forward_only: bool = False) -> Result:
    from dualpipe_megatron.megatron.schedule import make_forward_backward_func

    chunks, options = _our_layout(schedule, layers, dist.get_world_size(), tied)
    losses = _step(chunks, make_forward_backward_func(options), m, seed, forward_only)
    return losses, ({} if forward_only else _grads(chunks, tied))


def _compare(name: str, ref: Result, got: Result) -> Records:
    """Losses on the last rank and every grad copy against the reference: the losses each rank
    holds, the worst relative max diffs over every rank, and the parameters no rank holds."""
    (ref_losses, ref_grads), (losses, grads) = ref, got
    loss_rel = [_max_diff(a, b) / max(float(a.abs().max()), 1e-30) for a, b in zip(ref_losses, losses)]
    grad_rel, exact = [], 0
    for gname, copies in grads.items():
        ref_grad = ref_grads[gname][0]
        for g in copies:
            diff = _max_diff(ref_grad, g)
            grad_rel.append(diff / max(float(ref_grad.abs().max()), 1e-30))
            exact += diff == 0.0
    held = _per_rank((sorted(grads), len(losses), len(ref_losses), max(loss_rel, default=0.0),
                      max(grad_rel, default=0.0), len(grad_rel), exact))
    missing = set() if not grads else set(ref_grads) - {n for names, *_ in held for n in names}
    return {name: {
        "losses_per_rank": [h[1] for h in held],
        "reference_losses": max(h[2] for h in held),
        "worst_loss_rel_diff": max(h[3] for h in held),
        "worst_grad_rel_diff": max(h[4] for h in held),
        "missing_parameters": sorted(missing),
        "grad_copies": sum(h[5] for h in held),
        "bitwise_equal_copies": sum(h[6] for h in held),
    }}


# Micro-batch counts as multiples of P: M = 3P only at P = 2 (test time; P = 4 runs M = 2P).
M_FACTORS = {2: (2, 3), 4: (2,)}


def step_checks(pp: int) -> Records:
    layers = 2 * pp
    results: Records = {}
    for tied in (False, True):
        for m in (f * pp for f in M_FACTORS[pp]):
            seed = 100 + m
            pp1 = _run_megatron(1, layers, m, seed, tied)
            onef1b = _run_megatron(pp, layers, m, seed, tied)
            tag = f"p{pp}_m{m}_{'tied' if tied else 'untied'}"
            results |= _compare(f"1f1b_vs_pp1_{tag}", pp1, onef1b)
            for schedule in ("dualpipev", "dualpipe"):
                got = _run_ours(schedule, layers, m, seed, tied)
                results |= _compare(f"{schedule}_vs_pp1_{tag}", pp1, got)
                results |= _compare(f"{schedule}_vs_1f1b_{tag}", onef1b, got)
            if not tied and m == 2 * pp:
                results |= _budget_check(pp, layers, m, seed, onef1b)
    m = 2 * pp
    ref = _run_megatron(pp, layers, m, 5, False, forward_only=True)
    for schedule in ("dualpipev", "dualpipe"):
        results |= _compare(f"{schedule}_forward_only_p{pp}", ref,
                            _run_ours(schedule, layers, m, 5, False, forward_only=True))
    return results


def _budget_check(pp: int, layers: int, m: int, seed: int, ref: Result) -> Records:
    """DualPipeV under an activation budget below DeepSeek's own peak (``max_activations``, what
    ``--dualpipe-max-activations`` sets): another op order, the one a single process finds (the
    ranks shared the search), every rank within the budget, and 1F1B's losses and grads."""
    from dualpipe_megatron.megatron.schedule import make_forward_backward_func
    from dualpipe_megatron.schedules import Costs, build_schedule
    from dualpipe_megatron.schedules.events import peak_live_activations
    from dualpipe_megatron.schedules.optimize import optimize_order

    deepseek = build_schedule("dualpipev", pp, m)
    own = max(peak_live_activations(ops) for ops in deepseek.ops)
    budget = -(-3 * own // 4)  # the ceil(3/4 x DeepSeek's peak)
    chunks, options = _our_layout("dualpipev", layers, pp, False)
    options.max_activations = budget
    got = _step(chunks, make_forward_backward_func(options), m, seed), _grads(chunks, False)
    ran = options.job.schedules[(pp, m)]
    alone = optimize_order(deepseek, Costs.of(), max_activations=budget).ops == ran.ops
    name = f"budget_dualpipev_vs_1f1b_p{pp}_m{m}"
    record = _compare(name, ref, got)
    record[name] |= {
        "budget": budget, "deepseek_peak": own,
        "peaks_run": _per_rank([peak_live_activations(ops) for ops in ran.ops]),
        "order_differs_from_deepseek": _per_rank(ran.ops != deepseek.ops),
        "order_is_one_process_order": _per_rank(alone),
    }
    return record


def _sharded_keys(chunks: list[torch.nn.Module]) -> set[tuple]:
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    keys = set()
    for model in chunks:
        for sh in nested_values(model.sharded_state_dict()):
            if isinstance(sh, ShardedTensor):
                keys.add((sh.key, tuple(sh.global_offset), tuple(sh.global_shape)))
    return keys


def _all(keys: set) -> set:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(keys))
    return {k for part in gathered for k in part}


def checkpoint_key_checks(pp: int) -> Records:
    layers = 2 * pp
    chunks, _ = _our_layout("dualpipev", layers, pp, tied=False)
    numbers = sorted(layer.layer_number for c in chunks for layer in c.decoder.layers)
    ours = _all(_sharded_keys(chunks))
    theirs = _all(_sharded_keys(_megatron_layout(layers, pp, tied=False)))
    return {f"dualpipev_checkpoint_keys_p{pp}": {
        "layer_numbers": sorted(n for part in _per_rank(numbers) for n in part),
        "sharded_keys": len(ours),
        "keys_only_ours": sorted(ours - theirs),
        "keys_only_1f1b": sorted(theirs - ours),
    }}


def mirror_checks(pp: int) -> Records:
    """prepare_model makes DualPipe's two copies equal even when they were built different."""
    from dualpipe_megatron.megatron.grads import mirrored_param_mismatch
    from dualpipe_megatron.megatron.model import prepare_model
    from dualpipe_megatron.megatron.schedule import stage_map_for

    chunks, options = _our_layout("dualpipe", 2 * pp, pp, tied=False)
    stage_map = stage_map_for("dualpipe", pp)
    rank = dist.get_rank()
    with torch.no_grad():
        for p in chunks[1].parameters():
            p.add_(1.0)  # direction-1 copies drift away
    before = mirrored_param_mismatch(chunks, stage_map, rank, options.mirror_group)
    prepare_model(chunks, options, rank, pp)
    after = mirrored_param_mismatch(chunks, stage_map, rank, options.mirror_group)
    shared = all(getattr(p, "shared", False) for p in chunks[1].parameters())
    return {f"dualpipe_mirrors_p{pp}": {
        "copy_difference_before": _per_rank(before),
        "copy_difference_after": _per_rank(after),
        "direction1_marked_shared": _per_rank(shared),
    }}


def _token_loss(output: torch.Tensor) -> tuple:
    """Megatron's 3-tuple loss: summed loss, token count, report."""
    total = output.float().sum()
    count = torch.tensor(output.numel(), dtype=torch.int)
    return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}


def _forward_step_tokens(data_iterator, model: torch.nn.Module):
    output, _ = _forward_step(data_iterator, model)
    return output, _token_loss


def _ddp_step(chunks: list[torch.nn.Module], fb, m: int, seed: int) -> tuple[list, dict]:
    """One step with Megatron DDP (overlapped reduce), its finalize and per-token loss."""
    from megatron.core.distributed import (
        DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads,
    )

    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=2000)
    wrapped = [DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0)
               for i, c in enumerate(chunks)]
    config = chunks[0].config
    config.calculate_per_token_loss = True
    syncs = [w.no_sync for w in wrapped]
    config.no_sync_func = syncs[0] if len(syncs) == 1 else syncs  # as megatron.training sets it
    config.finalize_model_grads_func = finalize_model_grads
    for w in wrapped:
        w.zero_grad_buffer()
    batches = _batches(seed, m)
    reports = fb(forward_step_func=_forward_step_tokens, data_iterator=[iter(batches) for _ in wrapped],
                 model=wrapped, num_microbatches=m, seq_length=SEQ,
                 micro_batch_size=batches[0]["tokens"].shape[0])
    grads: dict[str, list[torch.Tensor]] = {}
    for model in chunks:
        for name, p in model.named_parameters():
            gname = global_param_name(model, name)
            if model.share_embeddings_and_output_weights and gname == "output_layer.weight":
                gname = "embedding.word_embeddings.weight"
            grads.setdefault(gname, []).append(p.main_grad.detach().clone())
    return [r["lm loss"] for r in reports] if reports else [], grads


def ddp_checks(pp: int) -> Records:
    """DDP + finalize_model_grads + per-token loss: ours against Megatron's 1F1B doing the same."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from dualpipe_megatron.megatron.schedule import make_forward_backward_func

    layers, m, seed = 2 * pp, 2 * pp, 77
    ref_losses, ref_grads = _ddp_step(_megatron_layout(layers, pp, True), get_forward_backward_func(), m, seed)
    ref = (ref_losses, _union(ref_grads))
    results: Records = {}
    for schedule in ("dualpipev", "dualpipe"):
        chunks, options = _our_layout(schedule, layers, pp, True)
        results |= _compare(f"{schedule}_ddp_per_token_p{pp}", ref,
                            _ddp_step(chunks, make_forward_backward_func(options), m, seed))
    return results


def _linear_weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Weights of Megatron's local linears: the ones a w:false backward defers."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return {f"{name}.weight": mod.weight for name, mod in model.named_modules()
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) and mod.weight is not None}


def _deferred_backward_check(ddp: bool) -> Records:
    """One micro-batch: a w:false backward leaves every linear weight's grad untouched; its W
    then gives exactly the full backward's grads."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from dualpipe_megatron.megatron.wgrad_megatron import install_linear_deferral
    from dualpipe_megatron.runtime.wgrad import WeightGradStore, deferring

    install_linear_deferral()
    batch = _batches(3, 1)[0]
    grads = []
    for defer in (False, True):
        (model,) = _megatron_layout(2, 1, False)
        wrapped = model
        if ddp:
            wrapped = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
            wrapped.zero_grad_buffer()
        read = (lambda p: p.main_grad.clone()) if ddp else (lambda p: None if p.grad is None else p.grad.clone())
        loss = wrapped(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float().mean()
        before = {n: read(p) for n, p in _linear_weights(model).items()}
        with deferring("mb0", enabled=defer):
            loss.backward()
        after_b = {n: read(p) for n, p in _linear_weights(model).items()}
        untouched = all((a is None and b is None) or (a is not None and torch.equal(a, b))
                        for a, b in zip(before.values(), after_b.values()))
        if defer:
            WeightGradStore.pop("mb0")
        grads.append(({n: read(p) for n, p in _linear_weights(model).items()}, untouched))
    (full, _), (split, untouched) = grads
    changed = [n for n in full if not torch.equal(full[n], split[n])]
    return {f"wgrad_split_{'ddp' if ddp else 'plain'}_p{dist.get_world_size()}": {
        "linear_weights": _per_rank(len(full)),
        "untouched_by_w_false_backward": _per_rank(untouched),
        "differ_from_full_backward_after_w": _per_rank(changed),
    }}


def _train_steps(schedule: str, defer: bool, steps: int = 3) -> tuple[dict[str, torch.Tensor], int]:
    """Three optimizer steps with Megatron DDP (overlapped grad reduce): the parameters after,
    and how many weight-grad closures the W ops ran."""
    from megatron.core.distributed import (
        DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from dualpipe_megatron.megatron.schedule import make_forward_backward_func

    pp = dist.get_world_size()
    chunks, options = _our_layout(schedule, 2 * pp, pp, True)
    options.defer_weight_grads = defer
    wrapped = [DistributedDataParallel(c.config, DistributedDataParallelConfig(overlap_grad_reduce=True),
                                       c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    config = chunks[0].config
    config.no_sync_func = [w.no_sync for w in wrapped]
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0), wrapped)
    fb = make_forward_backward_func(options)
    deferred = 0
    for step in range(steps):
        for w in wrapped:
            w.zero_grad_buffer()
        optimizer.zero_grad()
        _step(wrapped, fb, 2 * pp, 300 + step)
        deferred += options.last_stats.deferred
        optimizer.step()
    params = {f"{c}.{n}": p.detach().clone() for c, m in enumerate(chunks) for n, p in m.named_parameters()}
    return params, deferred


def wgrad_checks(pp: int) -> Records:
    results = _deferred_backward_check(ddp=False) | _deferred_backward_check(ddp=True)
    for schedule in ("dualpipev", "dualpipe"):
        (on, deferred_on), (off, deferred_off) = _train_steps(schedule, True), _train_steps(schedule, False)
        worst = max(float((on[n] - off[n]).abs().max() / off[n].abs().max().clamp(min=1e-30)) for n in on)
        moved = sum(1 for n in on if not torch.equal(on[n], off[n]))
        results[f"wgrad_overlap_reduce_{schedule}_p{pp}"] = {
            "deferred_closures_on": _per_rank(deferred_on),
            "deferred_closures_off": _per_rank(deferred_off),
            "worst_parameter_rel_diff": max(_per_rank(worst)),
            "parameters_not_bitwise": sum(_per_rank(moved)),
            "parameters": sum(_per_rank(len(on))),
        }
    return results


def _fp8_events(build, forward_backward, layers: int, m: int) -> dict[tuple[int, int], list]:
    """Per chunk (rank, model stage), in order: its first-micro-batch flags and FP8-context
    entries during one step.

    FP8 itself needs Transformer Engine; here the config says fp8 and the context factory
    TransformerBlock calls is a recorder, so the sequence of entries is what is compared.
    """
    from contextlib import nullcontext

    from megatron.core.transformer import module as mcore_module, transformer_block

    events: list[tuple] = []

    def record_context(config, layer_no: int = -1, is_init: bool = False):
        events.append(("fp8", layer_no))
        return nullcontext()

    def record_first(self) -> None:
        events.append(("first", tuple(layer.layer_number - 1 for layer in self.decoder.layers)))

    saved = (transformer_block.get_fp8_context, mcore_module.MegatronModule.set_is_first_microbatch)
    transformer_block.get_fp8_context = record_context
    mcore_module.MegatronModule.set_is_first_microbatch = record_first
    try:
        chunks = build()
        for c in chunks:
            c.config.fp8, c.config.fp8_recipe = "e4m3", "tensorwise"
        _step(chunks, forward_backward(), m, 9)
    finally:
        transformer_block.get_fp8_context, mcore_module.MegatronModule.set_is_first_microbatch = saved
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, events)
    per_chunk: dict[tuple[int, tuple], list] = {}
    for rank, rank_events in enumerate(gathered):
        chunk_of = {layer: chunk for kind, chunk in rank_events if kind == "first" for layer in chunk}
        for kind, what in rank_events:
            chunk = what if kind == "first" else chunk_of.get(what)
            per_chunk.setdefault((rank, chunk), []).append((kind, what))
    return per_chunk


def _forwards_per_layer(per_chunk: dict) -> tuple[dict[int, int], list]:
    """How many forwards each layer ran in FP8 context, and the chunks whose sequence is not
    'one first-micro-batch flag, then whole forwards of its layers in order'."""
    counts: dict[int, int] = {}
    bad = []
    for (rank, chunk), seq in per_chunk.items():
        entries = [what for kind, what in seq[1:]]
        n = len(entries) // max(len(chunk or ()), 1)
        if chunk is None or seq[0] != ("first", chunk) or entries != list(chunk) * n:
            bad.append((rank, chunk))
            continue
        for layer in chunk:
            counts[layer] = counts.get(layer, 0) + n
    return counts, bad


def fp8_checks(pp: int) -> Records:
    """FP8-context entries and first-micro-batch flags per chunk equal Megatron interleaved's
    for the same micro-batches (DualPipe: each copy of a stage runs half of them)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from dualpipe_megatron.megatron.schedule import make_forward_backward_func

    layers, m = 2 * pp, 2 * pp

    def interleaved() -> list[torch.nn.Module]:
        _parallel(pp, 2, tied_local=False)
        config = _config(layers, pp, 2)
        return [_gpt(config, ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                     ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v), False, v) for v in range(2)]

    ref_counts, ref_bad = _forwards_per_layer(_fp8_events(interleaved, get_forward_backward_func, layers, m))
    results: Records = {}
    for schedule in ("dualpipev", "dualpipe"):
        state: dict = {}

        def ours() -> list[torch.nn.Module]:
            chunks, state["options"] = _our_layout(schedule, layers, pp, False)
            return chunks

        got = _fp8_events(ours, lambda: make_forward_backward_func(state["options"]), layers, m)
        counts, bad = _forwards_per_layer(got)
        results[f"fp8_sequence_{schedule}_p{pp}"] = {
            "chunks": len(got),
            "chunks_out_of_sequence": bad,
            "interleaved_chunks_out_of_sequence": ref_bad,
            "forwards_per_layer": sorted(counts.items()),
            "interleaved_forwards_per_layer": sorted(ref_counts.items()),
        }
    return results


def recompute_checks(pp: int) -> Records:
    """Activation recompute (full and selective) composes with our schedules and the W split."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from dualpipe_megatron.megatron.schedule import make_forward_backward_func

    layers, m = 2 * pp, 2 * pp
    results: Records = {}
    for name, extra in (("full", dict(recompute_granularity="full", recompute_method="uniform",
                                      recompute_num_layers=1)),
                        ("selective", dict(recompute_granularity="selective"))):
        chunks = _megatron_layout(layers, pp, False, **extra)
        ref_losses = _step(chunks, get_forward_backward_func(), m, 21)
        ref = (ref_losses, _union(_grads(chunks, False)))
        chunks, options = _our_layout("dualpipev", layers, pp, False, **extra)
        got = (_step(chunks, make_forward_backward_func(options), m, 21), _grads(chunks, False))
        key = f"recompute_{name}_dualpipev_p{pp}"
        record = _compare(key, ref, got)
        record[key]["deferred_closures"] = _per_rank(options.last_stats.deferred)
        results |= record
    return results


def order_checks(pp: int) -> Records:
    """A valid DualPipeV schedule whose first stage runs its first two forwards in swapped
    micro-batch order: each forward must still read its own micro-batch (data by key)."""
    from dualpipe_megatron.megatron import schedule as adapter
    from dualpipe_megatron.schedules import F

    layers, m, seed = 2 * pp, 2 * pp, 41
    ref = _run_megatron(pp, layers, m, seed, False)
    original = adapter.build_schedule

    def swapped(name: str, ranks: int, microbatches: int):
        sched = original(name, ranks, microbatches)
        ops = sched.ops[0]
        i, j = [k for k, op in enumerate(ops) if isinstance(op, F) and op.key.s == 0][:2]
        ops[i], ops[j] = ops[j], ops[i]
        return sched

    adapter.build_schedule = swapped
    try:
        got = _run_ours("dualpipev", layers, m, seed, False)
    finally:
        adapter.build_schedule = original
    return _compare(f"out_of_order_forwards_dualpipev_p{pp}", ref, got)


def _seeded_stage_costs(stages: int, seed: int) -> dict:
    """A stage-cost file's contents with random whole costs (seed 0 moves the optimized order)."""
    rng = random.Random(seed)
    entries = []
    for s in range(stages):
        f = rng.randint(1, 6)
        b = rng.randint(f, 3 * f)
        entries.append({"d": 0, "s": s, "F": f, "B": b, "W": rng.randint(0, b - 1)})
    return {"c": 0, "stages": entries}


def plan_agreement_checks(pp: int) -> Records:
    """Rank 0 optimizes the DualPipeV order for a uniform stage-cost file, the other ranks for
    another one: every rank must raise PlanMismatchError before the step runs any op (the ranks
    share the search, so they compare its inputs first and name the costs)."""
    from dualpipe_megatron.megatron.schedule import make_forward_backward_func
    from dualpipe_megatron.runtime import PlanMismatchError
    from dualpipe_megatron.schedules import build_schedule
    from dualpipe_megatron.schedules.optimize import optimize_order
    from dualpipe_megatron.schedules.simulate import StageCosts

    layers, m = 2 * pp, 2 * pp
    files = [{"c": 0, "stages": [{"d": 0, "s": s, "F": 1, "B": 2, "W": 1} for s in range(2 * pp)]},
             _seeded_stage_costs(2 * pp, 0)]
    costs = [StageCosts.from_json_obj(f) for f in files]
    base = build_schedule("dualpipev", pp, m)
    orders_differ = optimize_order(base, costs[0]).ops != optimize_order(base, costs[1]).ops
    chunks, options = _our_layout("dualpipev", layers, pp, False)
    options.optimize_for = costs[0 if dist.get_rank() == 0 else 1]
    error = ""
    try:
        _step(chunks, make_forward_backward_func(options), m, 43)
    except PlanMismatchError as exc:
        error = str(exc)
    return {f"plan_mismatch_dualpipev_p{pp}": {
        "orders_differ": _per_rank(orders_differ),
        "stats_of_ops_run": _per_rank(None if options.last_stats is None else str(options.last_stats)),
        "error": _per_rank(error),
    }}


def main(out_path: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    install_cpu_compat()
    pp = dist.get_world_size()
    results = (step_checks(pp) | ddp_checks(pp) | wgrad_checks(pp) | fp8_checks(pp)
               | recompute_checks(pp) | checkpoint_key_checks(pp) | mirror_checks(pp) | order_checks(pp)
               | plan_agreement_checks(pp))
    publish(out_path, results)


if __name__ == "__main__":
    main(sys.argv[1])
