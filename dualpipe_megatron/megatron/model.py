"""Building and preparing Megatron model chunks for DualPipe and DualPipeV.

A Megatron user builds one model chunk per virtual stage. Our schedules hold
two chunks per rank whose roles differ from Megatron's looped placement:
:func:`chunk_roles` says, for each chunk, which model stage it is and whether
it holds the embedding (``pre_process``) or the output layer and loss
(``post_process``); :func:`dualpipe_layout` numbers every layer globally; and
:func:`prepare_model` fixes what spans two chunks once they exist.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

from torch import nn

from ..patch_guard import PatchSet
from .grads import (
    broadcast_mirrored_params, build_mirror_group, mark_mirror_copies_shared, tie_embeddings_locally,
)
from .schedule import DualPipeOptions
from .refusals import configuration_problems, stage_map_for
from .topology import DualPipeLayout, StageMap, stage_layer_types
from .wgrad_megatron import install_linear_deferral
from .wgrad_te import install_delayed_wgrad_deferral


@dataclass(frozen=True)
class ChunkRole:
    """What chunk ``vp_stage`` of a rank holds."""

    vp_stage: int
    stage: int
    pre_process: bool
    post_process: bool


def chunk_roles(stage_map: StageMap, rank: int) -> list[ChunkRole]:
    return [
        ChunkRole(c, stage_map.stage(rank, c), stage_map.is_first(rank, c), stage_map.is_last(rank, c))
        for c in range(stage_map.chunks)
    ]


def check_configuration(schedule: str, pipeline_size: int, num_microbatches: int | None,
                        num_layers: int, layout: str | list | None = None, mtp_layers: int = 0) -> None:
    """Reject a configuration our schedules cannot run, before any model is built."""
    problems = configuration_problems(schedule, pipeline_size, num_microbatches, num_layers, layout, mtp_layers)
    if problems:
        raise ValueError("; ".join(problems))


def dualpipe_layout(schedule: str, pipeline_size: int, num_layers: int,
                    layout: str | list | None = None, mtp_layers: int = 0) -> DualPipeLayout:
    """Megatron layer layout for our placement: pass it as ``pipeline_model_parallel_layout``."""
    stage_map = stage_map_for(schedule, pipeline_size)
    return DualPipeLayout(stage_layer_types(num_layers, stage_map.num_stages, layout, mtp_layers), stage_map)


def prepare_model(model: Sequence[nn.Module], options: DualPipeOptions, rank: int,
                  ranks: int) -> DualPipeOptions:
    """Once, after the chunks are built and before the optimizer: tie embeddings locally and,
    for DualPipe, make the mirrored copies equal and mark the second copy shared. Also installs
    the weight-gradient deferral patches (inert outside a ``B`` with ``w:false``).

    Collective over the world for DualPipe (it creates the mirror-pair groups).
    """
    install_linear_deferral()
    install_delayed_wgrad_deferral()
    stage_map = stage_map_for(options.schedule, ranks)
    tie_embeddings_locally(model, stage_map, rank)
    options.job.prepared = True
    if options.schedule == "dualpipe":
        options.job.mirror_group = build_mirror_group()
        broadcast_mirrored_params(model, stage_map, rank, options.job.mirror_group)
        mark_mirror_copies_shared(model)
        save_mirror_copies_as_replicas(model[1])
    return options


# Holds each patched chunk until uninstall_mirror_replicas().
MIRROR_REPLICAS = PatchSet("mirror replicas")


def _as_replica(sharded: Any) -> None:
    rid = sharded.replica_id
    sharded.replica_id = (rid[0] + 1, *rid[1:]) if isinstance(rid, tuple) else rid + 1


def save_mirror_copies_as_replicas(chunk: nn.Module) -> None:
    """DualPipe's direction-1 copy saves as a replica of direction 0's, so a checkpoint holds
    each parameter once (the same convention as Megatron's tied output-layer copy) and loads
    into every copy, under any schedule. Patches this chunk's ``sharded_state_dict`` only, once."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.utils import unwrap_model

    module = unwrap_model(chunk)  # Megatron's checkpointing unwraps DDP/Float16 before asking
    original = module.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(*args: Any, **kwargs: Any) -> dict:
        state = original(*args, **kwargs)
        for sharded in nested_values(state):
            if hasattr(sharded, "replica_id"):
                _as_replica(sharded)
        return state

    MIRROR_REPLICAS.patch(module, "sharded_state_dict", sharded_state_dict,
                          "(prefix='', sharded_offsets=(), metadata=None)")


def uninstall_mirror_replicas() -> None:
    """Give every patched chunk its class's ``sharded_state_dict`` back."""
    MIRROR_REPLICAS.restore()


def embedding_ranks(pp_ranks: list[int], *_: Any) -> list[int]:
    """``get_embedding_ranks`` for ``initialize_model_parallel``: our ties are local to one rank,
    so the embedding group is the first pipeline rank alone (a size-1 group Megatron skips);
    the default [first, last] group would make rank 0 wait in a collective the last rank never
    joins."""
    return [pp_ranks[0]]


def model_config_kwargs(schedule: str, pipeline_size: int, num_layers: int,
                        layout: str | list | None = None, mtp_layers: int = 0) -> dict[str, Any]:
    """TransformerConfig fields our placement needs (virtual size and layout)."""
    return {
        "pipeline_model_parallel_size": pipeline_size,
        "virtual_pipeline_model_parallel_size": 2,
        "pipeline_model_parallel_layout": dualpipe_layout(schedule, pipeline_size, num_layers, layout, mtp_layers),
    }


def global_param_name(model: nn.Module, name: str) -> str:
    """A chunk parameter's name in the unsplit model (global layer number, global expert index),
    so parameters can be compared across pipeline layouts and schedules."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        layer = model.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)
        if "local_experts" in parts:
            i = parts.index("local_experts") + 1
            parts[i] = str(layer.mlp.local_expert_indices[int(parts[i])])
    return ".".join(parts)
