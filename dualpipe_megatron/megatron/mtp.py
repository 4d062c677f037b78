"""Multi-token prediction's logged losses: recorded per micro-batch, replayed where Megatron logs.

Megatron adds each MTP depth's loss and acceptance counts of every micro-batch into
``MTPLossLoggingHelper.tracker`` on the rank that computes them, and its training log
prints them from the last rank, which holds the MTP block under 1F1B. Our loss
stages live elsewhere (DualPipeV: pipeline rank 0; DualPipe: both end ranks, one
direction's micro-batches each). So during a training step the values are recorded
with their global micro-batch instead of added up, and after the step every
pipeline rank adds all of them into its tracker in micro-batch order: the same sums,
in the same order, as 1F1B's last rank (bit-exact, whatever rank ran which micro-batch).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..patch_guard import PatchSet

PATCHES = PatchSet("MTP metrics")
_recording: list[list] = []  # the active step's records (innermost last)


def _install() -> None:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper as helper

    if PATCHES.is_patched(helper, "save_metrics_to_tracker"):
        return
    original = helper.save_metrics_to_tracker

    def save_metrics_to_tracker(loss: torch.Tensor, correct: torch.Tensor, total: torch.Tensor,
                                layer_number: int | None, num_layers: int, reduce_group: Any = None,
                                avg_group: Any = None) -> None:
        if not _recording or layer_number is None:
            return original(loss, correct, total, layer_number, num_layers, reduce_group, avg_group)
        records, microbatch = _recording[-1]
        records.append((microbatch(), layer_number, num_layers,
                        *(t.detach().cpu() for t in (loss, correct, total))))

    PATCHES.patch(helper, "save_metrics_to_tracker", save_metrics_to_tracker,
                  "(loss, correct, total, layer_number, num_layers, reduce_group=None, avg_group=None)")


@contextmanager
def recording_mtp_metrics(config: Any, microbatch: Callable[[], int | None]) -> Iterator[list | None]:
    """Record MTP metrics with ``microbatch()`` (the global micro-batch whose forward runs)
    instead of adding them up; yields the records (None without MTP: nothing to record)."""
    if not getattr(config, "mtp_num_layers", None):
        yield None
        return
    _install()
    records: list = []
    _recording.append((records, microbatch))
    try:
        yield records
    finally:
        _recording.pop()


def replay_mtp_metrics(records: list, group: dist.ProcessGroup, device: torch.device) -> None:
    """Collective over the pipeline group: every rank adds every rank's records into its
    tracker in (micro-batch, depth) order, as 1F1B's last rank would have."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    every: list = [None] * group.size()
    dist.all_gather_object(every, records, group=group)
    avg_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for _, layer, layers, loss, correct, total in sorted((r for rs in every for r in rs), key=lambda r: r[:2]):
        # Outside recording_mtp_metrics the patched method is Megatron's own.
        MTPLossLoggingHelper.save_metrics_to_tracker(loss.to(device), correct.to(device), total.to(device),
                                                     layer, layers, avg_group=avg_group)


__all__ = ["recording_mtp_metrics", "replay_mtp_metrics"]
