"""A torchrun stand-in for the tests' small CPU jobs: import once, fork the ranks.

Importing torch and Megatron takes ~9 s of CPU per process, most of a small test
job's start-up (a 4-rank job spends ~20 s of its ~30 s there on 2 cores). This
launcher imports ``scripts/pretrain_gpt.py`` and installs its hooks (as the script
does when run directly), then forks one child per rank with torchrun's
environment (``launcher.rank_env``) and runs the script's ``main`` there. Nothing
distributed, and no thread pool (``OMP_NUM_THREADS=1``), exists before the fork. The first
rank to fail takes the others down, and every child dies with the launcher (a test timeout
kills it). Each rank leads a process group, stopped at the end so that no helper process it
started outlives the job.

Megatron's ``torch_dist`` checkpoint save hands each rank's write results through a queue held
by a ``multiprocessing`` manager, which it starts with ``spawn`` on a rank's first save; that
fresh process then imports torch to unpickle the results, about 15 s of a 4-rank job's first
save on 2 cores. The launcher starts one manager by forking itself (torch already imported,
no threads yet) and gives each rank its own queue there, so a save costs what it costs.

    python tests/fork_launch.py NPROC PORT [pretrain_gpt.py arguments ...]
    python tests/fork_launch.py --serve    # what launcher.fork_pretrain uses: one import for all jobs

As a server it imports once for the whole test session and forks a launcher per job (asked
for on stdin), which installs the hooks in the job's environment and forks the ranks as above.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import runpy
import sys
import traceback
from collections.abc import Callable
from multiprocessing.managers import SyncManager

from launcher import PRETRAIN_GPT, REPO, die_with_parent, rank_env, stop_group


def _fork(child: Callable[[], int]) -> int:
    """Fork; the child runs ``child`` and exits with its code. Output is flushed first, so that
    neither process writes what the other had buffered."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os._exit(child())
    return pid


def _checkpoint_write_queues(nproc: int) -> tuple[SyncManager, list]:
    """One queue per rank for Megatron's checkpoint writer, in a manager forked from here."""
    manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start(initializer=die_with_parent)
    return manager, [manager.Queue() for _ in range(nproc)]


def _rank(rank: int, nproc: int, port: str, argv: list[str], write_queue: object) -> int:
    """Run in a forked child: become rank ``rank`` of ``nproc`` and train."""
    die_with_parent()
    os.setpgid(0, 0)  # the rank and the helper processes it starts: one group to stop together
    os.environ.update(rank_env(rank, nproc, port))
    sys.argv = argv
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = write_queue  # what Megatron's first save would spawn
    sys.stdout.reconfigure(line_buffering=True)  # what a killed peer printed is not lost
    sys.stderr.reconfigure(line_buffering=True)
    try:
        runpy.run_path(argv[0], run_name="__main__")  # as python -m dualpipe_megatron.launch runs it
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported, then the rank exits non-zero
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _import_once() -> None:
    sys.path[:0] = [str(REPO / "scripts"), str(REPO)]
    import pretrain_gpt  # noqa: F401 - torch, Megatron and the script, once for every rank


def launch(nproc: int, port: str, args: list[str], script: str = str(PRETRAIN_GPT)) -> int:
    """Install our hooks, fork the ranks and wait for them; the first failure's exit code."""
    from dualpipe_megatron.routes import install_for_training

    install_for_training()
    manager, write_queues = _checkpoint_write_queues(nproc)
    argv = [script, *args]
    children = {}
    for rank in range(nproc):
        pid = _fork(functools.partial(_rank, rank, nproc, port, argv, write_queues[rank]))
        children[pid] = rank
    groups = list(children)
    failed = 0
    while children:
        pid, status = os.wait()
        if pid not in children:
            continue  # the checkpoint-queue manager
        children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code if code > 0 else 128 - code
            for other in children:  # a failed rank leaves its peers waiting in a collective
                stop_group(other)
    # A rank's os._exit can leave helper processes behind: stop whatever each rank's group still holds.
    for group in groups:
        stop_group(group)
    manager.shutdown()
    return failed


def _job(request: dict) -> int:
    """In a child of the server: one job with the request's log, environment and working directory."""
    die_with_parent()
    os.setpgid(0, 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    try:
        return launch(request["nproc"], request["port"], request["args"], request["script"])
    except BaseException:  # noqa: BLE001 - reported in the job's log
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def serve() -> int:
    """Import once, then run the jobs asked for on stdin, one JSON line each, one at a time.

    Answers each with ``{"pid": ...}`` when the job starts (its launcher process, which the
    client may kill) and ``{"code": ...}`` when it ends. Exits when stdin closes."""
    die_with_parent()
    _import_once()
    for line in sys.stdin:
        pid = _fork(functools.partial(_job, json.loads(line)))
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
    return 0


def main() -> int:
    if sys.argv[1:] == ["--serve"]:
        return serve()
    nproc, port, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    _import_once()
    return launch(nproc, port, args)


if __name__ == "__main__":
    sys.exit(main())
