"""Child processes that tests start: every one reaped, none waited on forever.

torchrun's workers (and the ranks Lightning's spawn launcher starts) can live in process groups
or sessions of their own, outlive the process the test started and keep its pipes open; killing
that process's group then leaves them running and a read of its output never ends. These
helpers mark a job's processes with an environment variable (inherited by every descendant that
does not clear its environment; torchrun and multiprocessing keep it), kill every process so
marked or below the job's first process, and send output to files, never to pipes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...), or None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _ppid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (exited, waiting to be reaped)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (pp := _ppid(int(d.name))) is not None:
            children.setdefault(pp, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


JOB_VAR = "LIGHTNING_ONEBIT_TEST_JOB"


def marked(tag: str) -> list[int]:
    """Live processes whose environment has ``JOB_VAR=tag`` (re-parented orphans included)."""
    needle, out = f"{JOB_VAR}={tag}".encode(), []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
    return out


def kill_tree(proc: subprocess.Popen, tag: str | None = None, *, wait_s: float = 30.0) -> None:
    """SIGKILL ``proc``, everything below it and every process marked ``tag`` (their own process
    groups too), then reap ``proc``.

    The tree is read before the first kill: once the parent dies its children are re-parented
    and can no longer be found from it (the mark still finds them)."""
    pids = [proc.pid, *descendants(proc.pid), *(marked(tag) if tag else [])]
    for pid in pids:
        for kill in (lambda p: os.killpg(os.getpgid(p), signal.SIGKILL), lambda p: os.kill(p, signal.SIGKILL)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=wait_s)


@contextlib.contextmanager
def started(cmd: list[str], log: Path, *, err_log: Path | None = None, **popen_kw) -> Iterator[subprocess.Popen]:
    """``Popen(cmd)`` with stdout in the file ``log`` and stderr there too or in ``err_log`` (so no
    read can block), in a new session and marked; on leaving, whatever is still running of it is
    killed (see :func:`kill_tree`)."""
    tag = uuid.uuid4().hex
    env = {**popen_kw.pop("env", os.environ), JOB_VAR: tag}
    with contextlib.ExitStack() as files:
        out = files.enter_context(open(log, "w"))
        err = files.enter_context(open(err_log, "w")) if err_log else subprocess.STDOUT
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
                                env=env, **popen_kw)
        try:
            yield proc
        finally:
            kill_tree(proc, tag)


class TimedOut(subprocess.TimeoutExpired):
    """A job that outlived its timeout; its message ends with the tail of its stderr, where every
    Python process of the job printed the stacks of its threads before it was killed."""

    def __str__(self) -> str:
        tail = (self.stderr or "")[-STACKS_TAIL:]
        return f"{super().__str__()}\n--- stderr (tail), the stacks of the job's processes at the timeout ---\n{tail}"


STACKS_TAIL = 20_000


def dump_stacks(proc: subprocess.Popen, wait_s: float = 3.0) -> None:
    """SIGABRT to ``proc`` and everything below it: Python processes started with
    ``PYTHONFAULTHANDLER=1`` print every thread's stack to their stderr as they die, which shows where
    a job that hangs waits."""
    for pid in [*descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGABRT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=wait_s)


def run(cmd: list[str], *, timeout: float, **popen_kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`` whose timeout
    cannot hang: output goes to files (``subprocess.run`` reads pipes that grandchildren may hold
    open forever after it killed the child), and on timeout or error the whole job is killed.
    On timeout every process of the job first prints its threads' stacks (see :func:`dump_stacks`)
    and :class:`TimedOut`, a ``subprocess.TimeoutExpired``, carries them."""
    env = {**popen_kw.pop("env", os.environ), "PYTHONFAULTHANDLER": "1"}
    with tempfile.TemporaryDirectory() as d:
        out, err = Path(d) / "stdout", Path(d) / "stderr"
        with started(cmd, out, err_log=err, env=env, **popen_kw) as proc:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                dump_stacks(proc)
                raise TimedOut(cmd, timeout, out.read_text(errors="replace"), err.read_text(errors="replace")) from None
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))
