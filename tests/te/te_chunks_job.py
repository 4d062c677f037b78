"""One rank of tests/te/test_te_chunks.py: the DeepSeek-V3 proxy's chunks with Transformer Engine layers,
built through the route ``megatron.training`` takes, and our W deferral run over every TE linear.

Run by the tests' fork server as a pretraining script (our hooks installed, ``sys.argv`` the job's
flags): Megatron's argument parsing and validation (our ``--pipeline-schedule`` hooks), its
initialization, its GPT model builder through ``build_virtual_pipeline_stages`` (our chunk roles,
then ``prepare_model``), with ``torch.cuda.is_available`` True for the construction only. Then,
per chunk, the two layer-slot ``backward_dw`` calls Megatron's ``TransformerLayerSchedulePlan.run``
makes (``mlp``, then ``pre_dispatch_computation``) on the chunk's own schedule plan, inside a
``B`` with ``w:false`` (``deferring``), then that micro-batch's W (``WeightGradStore.pop``). TE's
own ``backward_dw`` records which module reached it instead of popping a GEMM (no backward ran).
Prints ``TE_CHUNKS {json}``: what each chunk holds and which TE linears the W reached.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # run by path: te_helpers sits beside this file
from te_helpers import cuda_reported_available, te_backward_dw_owner, te_linears  # noqa: E402

MARK = "TE_CHUNKS"
SLOTS = ("mlp", "pre_dispatch_computation")  # the slots TransformerLayerSchedulePlan.run calls backward_dw on


def _build(args: argparse.Namespace) -> list[torch.nn.Module]:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models import dist_utils

    model_config = gpt_config_from_args(args)
    builder = model_config.get_builder_cls()(model_config)
    with cuda_reported_available():
        return dist_utils.build_virtual_pipeline_stages(
            builder.build_model, ProcessGroupCollection.use_mpu_process_groups(),
            args.virtual_pipeline_model_parallel_size)


def _w_reach(chunk: torch.nn.Module, key: tuple) -> dict:
    """Run the chunk's layer-slot ``backward_dw`` calls deferred, then its W; which TE linears'
    own ``backward_dw`` ran, and when."""
    from dualpipe_megatron.runtime.wgrad import WeightGradStore, deferring

    linears = te_linears(chunk)
    reached: list[tuple[int, bool]] = []

    def record(self: torch.nn.Module) -> None:
        reached.append((id(self), self.need_backward_dw()))

    plan = chunk.build_schedule_plan(None, None, None)
    with ExitStack() as stack:
        for owner in {te_backward_dw_owner(m) for m in linears}:
            stack.enter_context(mock.patch.object(owner, "backward_dw", record))
        with deferring(key):
            for i in range(plan.num_layers()):
                for slot in SLOTS:
                    getattr(plan.get_layer(i), slot).backward_dw()
        ran_in_b = len(reached)
        filed = WeightGradStore.pop(key)
    names = {id(m): name for name, m in chunk.named_modules()}
    delayed = {id(m) for m in linears if m.wgrad_store.delay_wgrad_compute()}
    hit = [i for i, _ in reached]
    return {"linears": dict(Counter(type(m).__name__ for m in linears)), "delayed": len(delayed),
            "ran_in_b": ran_in_b, "filed": filed, "reached_once": len(hit) == len(set(hit)),
            "not_reached": sorted(names[i] for i in delayed - set(hit)),
            "reached_not_delayed": sorted(names[i] for i in set(hit) - delayed),
            "te_gated_off": sorted(names[i] for i, need in reached if not need)}


def _chunk_report(chunk: torch.nn.Module, vp_stage: int) -> dict:
    mtp = getattr(chunk, "mtp", None)
    return {"vp_stage": vp_stage, "pre_process": chunk.pre_process, "post_process": chunk.post_process,
            "embedding": hasattr(chunk, "embedding"), "output_layer": hasattr(chunk, "output_layer"),
            "layers": [layer.layer_number for layer in chunk.decoder.layers],
            "mtp_layers": len(mtp.layers) if mtp is not None else 0,
            **_w_reach(chunk, (0, vp_stage, 0))}


def main() -> None:
    from megatron.core import parallel_state
    from megatron.training import training
    from megatron.training.arguments import parse_and_validate_args

    # Megatron's argument check asks the GPU's compute capability for grouped GEMMs: a Hopper's.
    with mock.patch.object(torch.cuda, "get_device_capability", lambda *_: (9, 0)):
        args = parse_and_validate_args()
    training.initialize_megatron()
    chunks = _build(args)
    report = {"rank": dist.get_rank(), "pipeline_rank": parallel_state.get_pipeline_model_parallel_rank(),
              "chunks": [_chunk_report(chunk, c) for c, chunk in enumerate(chunks)]}
    print(f"{MARK} {json.dumps(report)}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
