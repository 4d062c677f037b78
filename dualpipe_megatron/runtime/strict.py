"""Strict mode: prove, step by step, that what a run posted cannot deadlock on NCCL.

With ``DUALPIPE_NCCL_STRICT=1`` each pipeline step records its p2p posts and
waits (:class:`~.comm_log.CommLog`) and every collective issued through
``torch.distributed`` while the step runs (MoE all-to-all, router all-reduces),
conservatively as host-blocking. At the step's end each rank publishes its log
in the job's rendezvous store, reads the logs of its pipeline peers and, by
transitive closure, of every rank its collectives involve, and runs the NCCL
model on them twice: one queue per rank pair (torch's default) and one queue
per group (``init_process_group(device_id=...)``). A possible deadlock fails
the step on every rank with the model's report. gloo still executes the run,
so strict mode checks exactly the calls a CPU test made. Assumes the ranks
involved run their steps in the same sequence (as training loops do).
``DUALPIPE_NCCL_STRICT_DIR=DIR`` also writes each failing step's logs to DIR
for ``python -m dualpipe_megatron.runtime nccl-check``. The recorders are guarded
patches (one :class:`~dualpipe_megatron.patch_guard.PatchSet` per step, stacked on
any other set's patch of a collective), restored when the step ends or fails.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from ..patch_guard import PatchSet
from .comm_log import CommLog
from .nccl_model import Verdict, check

STRICT_ENV = "DUALPIPE_NCCL_STRICT"
STRICT_DIR_ENV = "DUALPIPE_NCCL_STRICT_DIR"
_KEY = "dualpipe_nccl_strict"
_KEEP = 8  # steps a published log stays in the store

# Collectives a step may issue, recorded while a step runs (called as torch.distributed.NAME),
# each with its leading parameters before ``group`` (found by name), which the guard checks.
COLLECTIVES = {
    "all_reduce": ["tensor", "op"],
    "all_gather": ["tensor_list", "tensor"],
    "all_gather_into_tensor": ["output_tensor", "input_tensor"],
    "reduce_scatter_tensor": ["output", "input", "op"],
    "reduce_scatter": ["output", "input_list", "op"],
    "all_to_all": ["output_tensor_list", "input_tensor_list"],
    "all_to_all_single": ["output", "input", "output_split_sizes", "input_split_sizes"],
    "broadcast": ["tensor", "src"],
    "reduce": ["tensor", "dst", "op"],
    "barrier": [],
    "gather": ["tensor", "gather_list", "dst"],
    "scatter": ["tensor", "scatter_list", "src"],
}


class NcclDeadlockError(RuntimeError):
    """The calls a step made could deadlock on NCCL (the message is the model's report)."""


def strict_from_env() -> bool:
    return os.environ.get(STRICT_ENV, "0") not in ("", "0", "false", "False")


def check_both_queue_models(programs: dict[int, list[dict[str, Any]]], warm: set) -> list[Verdict]:
    """The model's failed verdicts under per-pair and per-group unbatched queues (empty: safe)."""
    verdicts = [check(programs, unbatched=mode, warm=warm) for mode in ("pair", "group")]
    return [v for v in verdicts if not v.ok]


class StepRecorder:
    """Records one step's collectives into ``log`` and checks the job's logs at the end."""

    _active: "StepRecorder | None" = None
    _steps = 0  # strict steps begun by this process: the key under which logs are exchanged

    def __init__(self, log: CommLog) -> None:
        self.log = log
        self.patches = PatchSet("strict mode")

    def start(self) -> None:
        if StepRecorder._active is not None:
            raise RuntimeError("strict mode: a pipeline step started inside another one")
        StepRecorder._active = self
        StepRecorder._steps += 1
        self.step = StepRecorder._steps
        try:
            for name, leading in COLLECTIVES.items():
                self.patches.patch(dist, name, self._recording(name, getattr(dist, name)), leading,
                                   stack=True)
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        """Put the collectives back (idempotent)."""
        self.patches.restore()
        if StepRecorder._active is self:
            StepRecorder._active = None

    def _recording(self, name: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            extra = bound.arguments.get("kwargs", {})
            group = bound.arguments.get("group", extra.get("group")) or dist.group.WORLD
            members = dist.get_process_group_ranks(group)
            if len(members) > 1:
                what = f"{name} over ranks {members}"
                ident = self.log.collective(group.group_name, members, name, what)
                self.log.wait([ident], what)
            return original(*args, **kwargs)

        return collective

    # -- the check -------------------------------------------------------------------
    def check(self, timeout: float) -> None:
        """Exchange logs with every rank involved and fail if the model finds a deadlock."""
        logs = self._exchange(timeout)
        programs = {log["rank"]: log["events"] for log in logs.values()}
        warm = {tuple(w) for log in logs.values() for w in log["warm"]}
        failed = check_both_queue_models(programs, warm)
        if not failed:
            return
        out = os.environ.get(STRICT_DIR_ENV)
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            path = Path(out) / f"step{self.step}_rank{self.log.rank}.json"
            path.write_text(json.dumps({"warm": sorted(map(list, warm)), "programs": programs}))
        report = "\n".join(v.report() for v in failed)
        raise NcclDeadlockError(
            f"strict NCCL check, step {self.step}, rank {self.log.rank}: these calls could deadlock on NCCL\n"
            f"{report[:20000]}"
        )

    def _exchange(self, timeout: float) -> dict[int, dict[str, Any]]:
        store = dist.distributed_c10d._get_default_store()
        me = self.log.rank
        mine = self.log.to_json_obj()
        store.set(f"{_KEY}/{self.step}/{me}", json.dumps(mine))
        logs: dict[int, dict[str, Any]] = {me: mine}
        needed = set(self.log.pipeline) | {m for e in self.log.events if e.get("post") == "coll" for m in e["members"]}
        while needed - logs.keys():
            missing = sorted(needed - logs.keys())
            keys = [f"{_KEY}/{self.step}/{r}" for r in missing]
            try:
                store.wait(keys, timedelta(seconds=timeout))
            except RuntimeError as exc:
                raise NcclDeadlockError(
                    f"strict NCCL check, step {self.step}, rank {me}: no call log from ranks {missing} "
                    f"within {timeout:g}s (did they fail or run different steps?): {exc}"
                ) from exc
            for r, key in zip(missing, keys):
                logs[r] = log = json.loads(store.get(key))
                needed |= set(log["pipeline"])
                needed |= {m for e in log["events"] if e.get("post") == "coll" for m in e["members"]}
        if self.step > _KEEP:  # long read by every rank that needed it (ranks run steps together)
            try:
                store.delete_key(f"{_KEY}/{self.step - _KEEP}/{me}")
            except (RuntimeError, NotImplementedError):
                pass
        return logs


__all__ = ["COLLECTIVES", "NcclDeadlockError", "STRICT_DIR_ENV", "STRICT_ENV", "StepRecorder",
           "check_both_queue_models", "strict_from_env"]
