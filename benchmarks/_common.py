"""Helpers shared by the benchmark scripts: where the numbers come from and where they go.

Every script prints its tables to stdout. With ``--out PATH`` it also writes them to PATH, headed
by the date, the exact command line and the machine, so that a run can be compared with a later
one. No script writes into the repository's result documents (``benchmarks/RESULTS.md``,
``docs/results.md``): those are edited by hand from such output.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import platform
import shlex
import socket
import struct
import sys
import termios
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def repo_on_path() -> None:
    """Put the repository root on ``sys.path``, so that ``recipes`` imports when a script runs from a checkout."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


# -- where the numbers come from ---------------------------------------------------------------------------


def machine() -> str:
    """One line that says where the numbers come from: host, CPU, cores, kernel, Python, torch."""
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return (f"{platform.node()}, {cpu}, {os.cpu_count()} cores, Linux {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def stamp() -> str:
    """Local date and time of a run, e.g. '2026-11-22 08:52 UTC'."""
    return datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def command(script: str, argv: Sequence[str]) -> str:
    """The command line that reproduces a run, as it is typed from the repository root."""
    return " ".join(["python", f"benchmarks/{script}", *([shlex.join(argv)] if argv else [])])


def load_text(start: Sequence[float], end: Sequence[float]) -> str:
    """The load average at the start and at the end of a run.

    It matters on small shared machines: another CPU-bound job inflates codec times (CPU-bound) far
    more than fp32 communication times (link-bound), which skews the ratios.
    """
    return (f"load average (1/5/15 min) {start[0]:.2f}/{start[1]:.2f}/{start[2]:.2f} at start, "
            f"{end[0]:.2f}/{end[1]:.2f}/{end[2]:.2f} at end")


def require_root() -> bool:
    """The emulated cluster needs root (network namespaces, tc); say so if this process is not."""
    if os.geteuid() != 0:
        print("needs root (network namespaces, tc)", file=sys.stderr)
        return False
    return True


# -- where the numbers go ----------------------------------------------------------------------------------


def add_out_argument(ap: argparse.ArgumentParser) -> None:
    """``--out PATH``: also write the output to PATH (default: print only)."""
    ap.add_argument("--out", metavar="PATH",
                    help="also write the output, headed by date, command and machine, to PATH "
                         "(overwritten; default: print only)")


def header(script: str, argv: Sequence[str], extra: str = "") -> str:
    """The lines that head an ``--out`` file: date, exact command, machine (and ``extra``)."""
    lines = [f"Run {stamp()}", "", f"`{command(script, argv)}`", "", f"Machine: {machine()}"]
    if extra:
        lines += ["", extra]
    return "\n".join(lines) + "\n\n"


def write_out(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` (the file the user named with ``--out``)."""
    Path(path).write_text(text)
    print(f"wrote {path}", file=sys.stderr)


class _Tee:
    """A stdout that also writes to a file."""

    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


@contextlib.contextmanager
def tee_stdout(path: str | os.PathLike[str] | None, head: str = "") -> Iterator[None]:
    """Inside the block, what is printed to stdout also goes to ``path`` (after ``head``); nothing if None."""
    if path is None:
        yield
        return
    with open(path, "w") as f:
        f.write(head)
        stdout = sys.stdout
        sys.stdout = _Tee(stdout, f)  # type: ignore[assignment]
        try:
            yield
        finally:
            sys.stdout = stdout
    print(f"wrote {path}", file=sys.stderr)


# -- worker side of the emulated-cluster benchmarks --------------------------------------------------------


def read_link_counter(iface: str | None, name: str) -> int:
    """A counter of this node's link (``tx_bytes``, ``rx_bytes``); 0 without a link (``iface`` None).

    Workers run inside their node's network namespace, so sysfs shows their own veth.
    """
    if iface is None:
        return 0
    with open(f"/sys/class/net/{iface}/statistics/{name}") as f:
        return int(f.read())


def bytes_to_other_hosts() -> int:
    """Bytes this process has handed to its TCP connections with another address (the other nodes; ranks of
    one node meet on the node's own address): per connection, what the peer acknowledged plus what is still
    queued (``TCP_INFO``'s ``tcpi_bytes_acked`` + ``SIOCOUTQ``). Counted when written, unlike a link counter,
    which sees a step's tail only when a shaper or delay line lets it out; connections that closed drop out."""
    total = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))  # a duplicate: closing it leaves gloo's own
        except OSError:
            continue
        with sock:
            try:
                if (sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM
                        or sock.getpeername()[0] == sock.getsockname()[0]):
                    continue
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
                queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
            except OSError:  # a listening or unconnected socket has no peer
                continue
            total += struct.unpack_from("Q", info, 120)[0] + queued  # tcpi_bytes_acked
    return total


def init_gloo_worker(timeout_s: float) -> tuple[int, int]:
    """A torchrun worker of the emulated cluster: one thread (the nodes share the machine's cores), the
    package's strategies registered, the gloo group joined. Returns (rank, world size)."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    import lightning_onebit  # noqa: F401 - registers the strategies

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def emit_tagged(tag: str, row: dict[str, Any]) -> None:
    """Print one result as a tagged JSON line, for the driver to pick out of the worker's stdout."""
    print(tag + json.dumps(row), flush=True)


def parse_tagged(text: str, tag: str) -> list[dict[str, Any]]:
    """The results a worker printed with ``emit_tagged(tag, ...)``, in order."""
    return [json.loads(line[len(tag):]) for line in text.splitlines() if line.startswith(tag)]
