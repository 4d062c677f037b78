"""The tests' one launcher: start N ranks, bound them by a timeout, hand back structured results.

Every route gives its ranks the same rendezvous environment (:func:`rank_env`, torchrun's
variables, gloo on localhost) and strict mode (``DUALPIPE_NCCL_STRICT``, docs/nccl.md). Each
rank, or torchrun, or the fork server's job, leads a process group of its own: a rank that fails
stops the launch at once (its peers would wait in a collective), and what is still running at
the timeout is killed with its group, so a hang fails the test with every rank's output instead
of blocking the suite. Routes, by what the ranks run:

- :func:`spawn`: a function, in ``torch.multiprocessing`` spawned processes (no Megatron); each
  rank's return value comes back.
- :func:`run_script`: ``python WORKER OUT_JSON *args`` per rank; rank 0's JSON records (one per
  check: its measured values, which the test compares) come back.
- :func:`torchrun`: a command under torchrun, as a user starts it; its log comes back
  (:func:`marked_json` reads the JSON lines a rank printed).
- :func:`fork_pretrain`: ``scripts/pretrain_gpt.py`` through ``fork_launch.py``'s server, which
  imports torch and Megatron once for every job of the session and forks the ranks; its log.

A failed launch raises :class:`LaunchFailed`.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
FORK_LAUNCH = Path(__file__).with_name("fork_launch.py")
PRETRAIN_GPT = REPO / "scripts" / "pretrain_gpt.py"
STRICT_ENV = "DUALPIPE_NCCL_STRICT"  # dualpipe_megatron.runtime.strict.STRICT_ENV
TAIL = 8000  # characters of each log a failure report quotes
PR_SET_PDEATHSIG = 1
IMPORT_TIMEOUT = 300  # the fork server's one import of torch and Megatron, on a loaded machine

Records = dict[str, dict[str, object]]  # {check: {value name: JSON value}}


class LaunchFailed(RuntimeError):
    """A launch whose ranks did not all finish cleanly; the message quotes what they said."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int | str) -> dict[str, str]:
    """What torchrun tells rank ``rank`` of a one-node job of ``world`` ranks."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def launch_env(**extra: str) -> dict[str, str]:
    """What every launched rank gets on top of the caller's environment: one thread (two cores
    are shared by every rank) and strict mode unless the caller's environment says otherwise."""
    return {"OMP_NUM_THREADS": "1", STRICT_ENV: os.environ.get(STRICT_ENV, "1"), **extra}


def job_env(**extra: str) -> dict[str, str]:
    """The caller's environment with :func:`launch_env`'s variables and ``extra``."""
    return {**os.environ, **launch_env(**extra)}


def marked_json(log: str, mark: str) -> list[dict[str, Any]]:
    """Every ``MARK {json}`` a rank printed, parsed. Each object is decoded from its mark on, not
    matched to the end of its line: ranks share the log, and an unbuffered print writes its
    newline apart, so one rank's report may run on into another's."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(log, found.end())[0] for found in re.finditer(rf"{re.escape(mark)} (?=\{{)", log)]


def stop_group(pgid: int) -> None:
    """SIGKILL process group ``pgid`` (nothing if it is gone)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def die_with_parent() -> None:
    """This process gets SIGKILL when its parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _stop_running(procs: list[subprocess.Popen]) -> None:
    """Kill the process group of every rank still running (each leads its own)."""
    for p in procs:
        if p.poll() is None:
            stop_group(p.pid)
            p.wait()


def _watch(poll: Callable[[int], int | None], count: int, timeout: float,
           may_vanish: Collection[int] = ()) -> list[int | None]:
    """Exit codes once every rank is done, a rank outside ``may_vanish`` failed, or ``timeout``
    passed (``None``: still running)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [poll(r) for r in range(count)]
        failed = any(c not in (None, 0) and r not in may_vanish for r, c in enumerate(codes))
        if None not in codes or failed or time.monotonic() >= deadline:
            return codes
        time.sleep(0.2)


def _why(codes: list[int | None], timeout: float) -> str:
    return f"exit codes {codes} (None: killed, still running when a rank failed or after {timeout} s)"


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-TAIL:]


# -- spawn: a function per rank ---------------------------------------------------------------


def _leave_together(rank: int, world: int) -> None:
    """Rank 0 hosts the TCP store: it waits (bounded) until every peer is done with it before
    exiting, since a peer may still be reading the strict NCCL check's last call logs (CI once
    saw 'Connection reset by peer' there). Peers only announce themselves and go."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    store = dist.distributed_c10d._get_default_store()
    try:
        store.set(f"launcher/leaving/{rank}", "1")
        if rank == 0:
            store.wait([f"launcher/leaving/{r}" for r in range(1, world)], timedelta(seconds=20))
    except RuntimeError:  # a peer died or the store is gone: nothing left to protect
        pass


def _spawned(rank: int, world: int, env: dict[str, str], out_dir: str, fn: Callable, args: tuple) -> None:
    """A spawned rank: join the group, run ``fn``, pickle ``("ok", result)`` or ``("error", traceback)``."""
    die_with_parent()
    os.setpgid(0, 0)
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo")
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    _leave_together(rank, world)
    # Skip interpreter teardown: a rank that gave up on a peer may still have receives posted.
    os._exit(0 if result[0] == "ok" else 1)


def spawn(world: int, fn: Callable, *args: Any, timeout: float = 150.0,
          may_vanish: Collection[int] = ()) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.

    A rank in ``may_vanish`` (one that kills itself) may report nothing: its result is ``None``.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_spawned, args=(r, world, launch_env(**rank_env(r, world, port)),
                                                    out_dir, fn, args)) for r in range(world)]
        try:
            for p in procs:
                p.start()
            codes = _watch(lambda r: procs[r].exitcode, world, timeout, may_vanish)
        finally:
            for p in (p for p in procs if p.pid is not None):
                if p.exitcode is None:
                    stop_group(p.pid)  # its group, or nothing yet if it had not called setpgid
                    p.kill()
                p.join()
        results, problems = [], []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                results.append(None)
                if r not in may_vanish:
                    problems.append(f"rank {r} reported nothing")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            results.append(value)
            if status != "ok":
                problems.append(f"rank {r} failed:\n{value}")
    if problems:
        raise LaunchFailed(f"{getattr(fn, '__name__', fn)}: {_why(codes, timeout)}\n" + "\n".join(problems))
    return results


# -- run_script: a worker script per rank --------------------------------------------------------


def run_script(worker: Path, world: int, out_dir: Path, timeout: float, *args: str) -> Records:
    """Run ``python WORKER OUT_JSON *args`` on ``world`` ranks; return OUT_JSON's content."""
    from dualpipe_megatron.megatron.cpu_compat import DISABLE_ENV

    out = out_dir / "results.json"
    port = free_port()
    procs, logs = [], []
    try:
        for rank in range(world):
            env = job_env(**rank_env(rank, world, port))
            env.pop(DISABLE_ENV, None)  # every CPU stand-in on, whatever the caller's shell says
            logs.append(out_dir / f"rank{rank}.log")
            with logs[-1].open("w") as log:
                procs.append(subprocess.Popen([sys.executable, str(worker), str(out), *args], env=env,
                                              stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                              start_new_session=True))
        codes = _watch(lambda r: procs[r].poll(), world, timeout)
    finally:
        _stop_running(procs)
    if codes != [0] * world or not out.exists():
        report = "\n".join(f"--- rank {r} ---\n{_tail(log)}" for r, log in enumerate(logs))
        raise LaunchFailed(f"{worker.name} failed: {_why(codes, timeout)}\n{report}")
    return json.loads(out.read_text())


# -- torchrun and the fork server: whole jobs with one log ----------------------------------------


def _log_or_fail(name: str, code: int | str, cmd: list[str], log: Path) -> str:
    text = log.read_text(errors="replace")
    if code != 0:
        raise LaunchFailed(f"{name}: exit code {code}\n{' '.join(cmd)}\n{text[-TAIL:]}")
    return text


def torchrun(name: str, nproc: int, argv: list[str], env: dict[str, str], log: Path, timeout: float,
             python: str | None = None) -> str:
    """``torchrun --nproc-per-node NPROC ARGV`` in the repository (``python -m
    torch.distributed.run`` of another interpreter, whose ranks it starts too, if given); returns
    its log (``name`` heads a failure's report)."""
    launcher = [python, "-m", "torch.distributed.run"] if python else [str(TORCHRUN)]
    cmd = [*launcher, f"--nproc-per-node={nproc}", f"--master-port={free_port()}", *argv]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    try:
        [code] = _watch(lambda _: proc.poll(), 1, timeout)
    finally:
        _stop_running([proc])  # torchrun and the ranks it started
    if code is None:
        code = f"None (killed after {timeout} s)"
    return _log_or_fail(name, code, cmd, log)


class _ForkServer:
    """``fork_launch.py --serve``, started on first use and kept for the test session."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.pending = b""
        self.stderr = tempfile.TemporaryFile()  # the server's own output (its imports), for failures

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, str(FORK_LAUNCH), "--serve"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.stderr,
                                         env=job_env(PYTHONPATH=str(REPO)), cwd=REPO)
            self.pending = b""
        return self.proc

    def _answer(self, timeout: float) -> dict | None:
        """The server's next answer; ``None`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                self.stderr.seek(0)
                said = self.stderr.read().decode(errors="replace")[-TAIL:]
                raise LaunchFailed(f"the fork server (fork_launch.py --serve) exited:\n{said}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, nproc: int, args: list[str], env: dict[str, str], log: Path, timeout: float,
            script: Path) -> int | str:
        """One job's exit code (a string when it was killed at ``timeout``)."""
        proc = self._start()
        request = {"nproc": nproc, "port": str(free_port()), "args": args, "env": env, "log": str(log),
                   "cwd": str(REPO), "script": str(script)}
        proc.stdin.write((json.dumps(request) + "\n").encode())
        proc.stdin.flush()
        started = self._answer(IMPORT_TIMEOUT)
        if started is None:
            raise LaunchFailed(f"the fork server did not start a job within {IMPORT_TIMEOUT} s")
        ended = self._answer(timeout)
        if ended is None:
            os.kill(started["pid"], signal.SIGKILL)  # its ranks and manager die with it
            self._answer(60)
            return f"None (killed after {timeout} s)"
        return ended["code"]


_FORK_SERVER = _ForkServer()  # one server process for the session: its import is what it saves


def fork_pretrain(name: str, nproc: int, args: list[str], env: dict[str, str], log: Path,
                  timeout: float, script: Path = PRETRAIN_GPT) -> str:
    """``SCRIPT ARGS`` (``scripts/pretrain_gpt.py`` unless told) on ``nproc`` forked ranks, run as
    the launcher runs it; returns its log."""
    cmd = [sys.executable, str(FORK_LAUNCH), str(nproc), "PORT", *args]  # what the server runs
    return _log_or_fail(name, _FORK_SERVER.run(nproc, args, env, log, timeout, script), cmd, log)
