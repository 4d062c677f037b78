"""A torchrun stand-in for the tests' small CPU jobs: import once, fork the ranks.

Importing torch and Megatron takes ~9 s of CPU per process, most of a small test
job's start-up (a 4-rank job spends ~20 s of its ~30 s there on 2 cores). This
launcher imports ``scripts/pretrain_gpt.py`` and installs its hooks (as the script
does when run directly), then forks one child per rank with torchrun's
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``)
and runs the script's ``main`` there. Nothing distributed, and no thread pool
(``OMP_NUM_THREADS=1``), exists before the fork. The first rank to fail takes the
others down, and every child dies with the launcher (a test timeout kills it). Each rank leads
a process group, stopped at the end so that no helper process it started outlives the job.

    python tests/fork_launch.py NPROC PORT [pretrain_gpt.py arguments ...]
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PR_SET_PDEATHSIG = 1


def _rank(rank: int, nproc: int, port: str, argv: list[str]) -> int:
    """Run in a forked child: become rank ``rank`` of ``nproc`` and train."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setpgid(0, 0)  # the rank and the helper processes it starts: one group to stop together
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port)
    sys.argv = argv
    sys.stdout.reconfigure(line_buffering=True)  # what a killed peer printed is not lost
    sys.stderr.reconfigure(line_buffering=True)
    import pretrain_gpt

    try:
        pretrain_gpt.main()
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported, then the rank exits non-zero
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> int:
    nproc, port, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    sys.path[:0] = [str(REPO / "scripts"), str(REPO)]
    import pretrain_gpt  # noqa: F401 - torch, Megatron and the script, once for every rank

    from dualpipe_megatron.megatron.cpu_compat import install_cpu_compat
    from dualpipe_megatron.megatron.upstream_plugin import install_for_megatron

    install_cpu_compat()
    install_for_megatron()
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os._exit(_rank(rank, nproc, port, [str(REPO / "scripts" / "pretrain_gpt.py"), *args]))
        children[pid] = rank
    groups = list(children)
    failed = 0
    while children:
        pid, status = os.wait()
        children.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code if code > 0 else 128 - code
            for other in children:  # a failed rank leaves its peers waiting in a collective
                _stop_group(other)
    # Megatron's checkpoint save starts a persistent async worker per rank, which the ranks'
    # os._exit leaves behind (idle, ~600 MB each): stop whatever each rank's group still holds.
    for group in groups:
        _stop_group(group)
    return failed


def _stop_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main())
