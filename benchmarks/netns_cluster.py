"""Emulated multi-node cluster on one Linux box: network namespaces, a bridge and shaped veth links.

Why this exists: the whole point of 1-bit / 8-bit compressed allreduce is to save time on a slow link,
and a single machine has no such link between its processes. As root, one can be built on one box
(``docs/design/cluster.md``, "Emulated cluster benchmarks"); this module is that construction, used by
``benchmarks/collectives.py`` and ``benchmarks/e2e.py``.

Topology, created fresh per cluster and deleted afterwards::

    ns <prefix>-n0  [vn0 10.213.X.1/24]--veth--[vb0]
    ns <prefix>-n1  [vn1 10.213.X.2/24]--veth--[vb1]  ns <prefix>-br  (bridge br0: vb0, vb1, ...)
    ...

* Nothing is created or configured in the host's root network namespace: both ends of each veth pair
  are created directly inside namespaces we own, the bridge lives in its own namespace, and the
  addresses exist only inside those namespaces (so nothing outside them is ever addressed).
* Each link is shaped with ``tc qdisc ... tbf`` on *both* ends (node egress and bridge egress), so
  every node has ``rate`` up and ``rate`` down, like a NIC on a non-blocking switch.
* Teardown kills every process left in the namespaces and deletes them; it runs on normal exit,
  exceptions, SIGINT, SIGTERM/SIGHUP (handlers that unwind via ``SystemExit``) and ``atexit``.
  ``cleanup_stale()`` (``python benchmarks/netns_cluster.py --cleanup``) removes leftovers of runs that
  were SIGKILLed.

Requires root, ``ip`` (iproute2) and ``tc``, and the kernel's veth, bridge and sch_tbf modules.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import itertools
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType, TracebackType

PREFIX = "lob"
"""Every namespace this module creates starts with this (``lob<pid>c<seq>-n<k>`` / ``-br``)."""

_NAME_RE = re.compile(rf"^{PREFIX}(?P<pid>\d+)c(?P<seq>\d+)-(?:n\d+|br)$")
_SUBNET_BASE = "10.213"
DELAY_IFACE = "delay"
"""The delay line's TUN device in every node's namespace (``set_delay``)."""
_seq = itertools.count()
_live: list[EmulatedCluster] = []
_live_lock = threading.Lock()
_handlers_installed = False


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> str:
    """Run a short admin command (ip/tc) and return its stdout; raise with stderr on failure."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def parse_rate(rate: str) -> float:
    """Return a tc-style rate string ('1gbit', '100mbit', '500kbit', '1000000bit') in bits per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(bit|bps)\s*", rate.lower())
    if not m:
        raise ValueError(f"unsupported rate {rate!r}; use e.g. '1gbit', '10gbit', '100mbit'")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return value * 8 if m.group(3) == "bps" else value  # tc: 'bps' means bytes per second


def _tbf_args(rate: str, latency: str) -> list[str]:
    """tbf parameters for ``rate``.

    The bucket must hold at least a timer tick's worth of traffic and one full GSO super-packet (veth
    hands TCP segments of up to 64 KiB to the qdisc), otherwise tbf throttles below ``rate`` or has to
    re-segment. 1 ms of traffic, but at least 128 KiB, satisfies both at 1-10 Gbit/s.
    """
    burst = max(int(parse_rate(rate) / 8 * 1e-3), 128 * 1024)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", latency]


def _ns_list() -> list[str]:
    """Names of all network namespaces known to ``ip netns`` (output lines look like 'name (id: 3)')."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _ns_pids(ns: str) -> list[int]:
    """Process ids still running inside namespace ``ns`` (all of them were started by this module)."""
    out = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_ns_processes(ns: str, grace: float = 3.0, keep: Sequence[int] = ()) -> None:
    """SIGTERM, then SIGKILL, every process left in ``ns``.

    Needed because torchrun starts its workers in their own sessions, so killing the process group of
    what we launched does not reach them; and a namespace (with its veth and the ports its processes
    hold) only goes away once no process is left in it.
    """
    pids = [p for p in _ns_pids(ns) if p not in keep]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [p for p in _ns_pids(ns) if p not in keep]
        if not pids:
            return


def _delete_ns(ns: str) -> None:
    """Kill what runs in ``ns`` and delete it; tolerant of it being already gone."""
    if ns not in _ns_list():
        return
    _kill_ns_processes(ns)
    _run(["ip", "netns", "del", ns], check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(*, include_live_owners: bool = False, verbose: bool = True) -> list[str]:
    """Delete namespaces left behind by earlier runs (e.g. a SIGKILLed benchmark).

    Only names matching ``lob<pid>c<seq>-...`` are touched. By default namespaces whose creating process
    is still alive are kept (another benchmark may be using them); ``include_live_owners`` removes those
    too. Returns the deleted names.
    """
    removed = []
    for ns in _ns_list():
        m = _NAME_RE.match(ns)
        if not m:
            continue
        owner = int(m.group("pid"))
        if owner == os.getpid() or (_pid_alive(owner) and not include_live_owners):
            continue
        _delete_ns(ns)
        removed.append(ns)
        if verbose:
            print(f"removed stale namespace {ns}", file=sys.stderr)
    return removed


def _teardown_all() -> None:
    """atexit / signal backstop: tear down every cluster of this process that is still up."""
    with _live_lock:
        clusters = list(_live)
    for cluster in clusters:
        cluster.close()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Turn SIGTERM/SIGHUP into ``SystemExit`` so ``with`` blocks and ``finally`` clauses unwind."""
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    """Install atexit + SIGTERM/SIGHUP handlers once (SIGINT already raises KeyboardInterrupt)."""
    global _handlers_installed
    if _handlers_installed:
        return
    atexit.register(_teardown_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_signal)
    _handlers_installed = True


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Defer SIGINT/SIGTERM/SIGHUP so a second Ctrl-C cannot interrupt teardown half-way."""
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class EmulatedCluster:
    """``nodes`` emulated machines, each in its own network namespace, behind a shaped link of ``rate``.

    Use as a context manager::

        with EmulatedCluster(2, rate="1gbit") as c:
            p = c.popen(0, ["python", "-c", "..."], env)
            c.tx_bytes(0)

    ``rate=None`` leaves the links unshaped (only the CPU limits them).
    """

    def __init__(
        self,
        nodes: int,
        rate: str | None = "1gbit",
        *,
        latency: str = "50ms",
        subnet: int | None = None,
    ) -> None:
        if not 1 <= nodes <= 250:
            raise ValueError("nodes must be in 1..250")
        if rate is not None:
            parse_rate(rate)
        self.nodes = nodes
        self.rate = rate
        self.latency = latency
        seq = next(_seq)
        self.prefix = f"{PREFIX}{os.getpid()}c{seq}"
        # Third octet: varies per run only for readability; the addresses are private to our namespaces.
        self.subnet = subnet if subnet is not None else (os.getpid() + seq) % 250 + 1
        self.bridge_ns = f"{self.prefix}-br"
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._up = False
        self._closed = False
        self._delay_lines: list[subprocess.Popen[bytes]] = []

    # -- naming -----------------------------------------------------------------------------------------
    def ns(self, k: int) -> str:
        """Namespace name of node ``k``."""
        self._check_node(k)
        return f"{self.prefix}-n{k}"

    def iface(self, k: int) -> str:
        """Name of node ``k``'s veth inside its namespace (the value for ``GLOO_SOCKET_IFNAME``)."""
        self._check_node(k)
        return f"vn{k}"

    def node_ip(self, k: int) -> str:
        """Node ``k``'s address; it exists only inside this cluster's namespaces."""
        self._check_node(k)
        return f"{_SUBNET_BASE}.{self.subnet}.{k + 1}"

    def _check_node(self, k: int) -> None:
        if not 0 <= k < self.nodes:
            raise IndexError(f"node {k} not in 0..{self.nodes - 1}")

    # -- lifecycle --------------------------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        self.open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def open(self) -> None:
        """Create namespaces, bridge, veths, addresses and qdiscs; on any failure undo what was made."""
        if self._up:
            return
        if os.geteuid() != 0:
            raise PermissionError("EmulatedCluster needs root (ip netns / tc)")
        _install_handlers()
        with _live_lock:
            _live.append(self)  # before creating anything, so the signal/atexit backstop sees it
        self._up = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        self._add_ns(self.bridge_ns)
        br = self.bridge_ns
        _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        for k in range(self.nodes):
            ns, node_if, br_if = self.ns(k), self.iface(k), f"vb{k}"
            self._add_ns(ns)
            # Both ends are born inside our namespaces: the root namespace never sees them.
            _run(["ip", "link", "add", node_if, "netns", ns, "type", "veth", "peer", "name", br_if,
                  "netns", br])
            _run(["ip", "-n", br, "link", "set", br_if, "master", "br0"])
            _run(["ip", "-n", br, "link", "set", br_if, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.node_ip(k)}/24", "dev", node_if])
            _run(["ip", "-n", ns, "link", "set", node_if, "up"])
        self.set_rate(self.rate)
        self._wait_links_up()

    def _wait_links_up(self, timeout: float = 10.0) -> None:
        """Wait until every node veth reports carrier, so the first connect does not race link setup."""
        deadline = time.monotonic() + timeout
        for k in range(self.nodes):
            while True:
                state = _run(["ip", "netns", "exec", self.ns(k), "cat",
                              f"/sys/class/net/{self.iface(k)}/operstate"]).strip()
                if state == "up":
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.iface(k)} in {self.ns(k)} did not come up ({state})")
                time.sleep(0.05)

    def set_rate(self, rate: str | None) -> None:
        """(Re)shape every link to ``rate`` on both ends; ``None`` removes shaping.

        Lets one cluster be reused across rates without re-creating the namespaces.
        """
        if rate is not None:
            parse_rate(rate)
        for k in range(self.nodes):
            for ns, dev in ((self.ns(k), self.iface(k)), (self.bridge_ns, f"vb{k}")):
                if rate is None:
                    _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                else:
                    _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root",
                          *_tbf_args(rate, self.latency)])
        self.rate = rate

    def set_delay(self, rtt_ms: float) -> None:
        """Add ``rtt_ms`` of round trip between any two nodes: each node's egress waits ``rtt_ms / 2`` in a
        user-space delay line (``delay_line.py``: a TUN device in the node's namespace) before its shaped link.

        The kernel's ``tc netem`` would do this in one command; this one works where the kernel lacks it.
        Call once, after ``open``; the delay lines stop with the cluster.
        """
        if rtt_ms <= 0:
            raise ValueError(f"rtt_ms must be > 0, got {rtt_ms}")
        if self._delay_lines:
            raise RuntimeError("set_delay was already called on this cluster")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay_line.py")
        for k in range(self.nodes):
            ns, dev, table = self.ns(k), DELAY_IFACE, "100"
            proc = self.popen(k, [sys.executable, script, dev, str(rtt_ms / 2)], None, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
            self._delay_lines.append(proc)
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 10.0)
            if not ready or proc.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"the delay line of node {k} did not start (rc={proc.poll()})")
            for key, value in (("net.ipv4.ip_forward", "1"), ("net.ipv4.conf.all.rp_filter", "0"),
                               (f"net.ipv4.conf.{dev}.rp_filter", "0"), (f"net.ipv4.conf.{dev}.accept_local", "1")):
                _run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"])
            # the held packets are a round trip's worth of traffic: the default 500 could drop at 1 Gbit/s
            _run(["ip", "-n", ns, "link", "set", dev, "up", "txqueuelen", "20000"])
            for j in range(self.nodes):  # into the delay line: more specific than the link's /24
                if j != k:
                    _run(["ip", "-n", ns, "route", "add", f"{self.node_ip(j)}/32", "dev", dev, "src",
                          self.node_ip(k)])
            # out of the delay line: what enters from it leaves by the real link
            _run(["ip", "-n", ns, "route", "add", f"{_SUBNET_BASE}.{self.subnet}.0/24", "dev", self.iface(k),
                  "table", table])
            _run(["ip", "-n", ns, "rule", "add", "iif", dev, "lookup", table, "pref", "100"])

    def set_slow_start_after_idle(self, enabled: bool) -> None:
        """Set the nodes' ``net.ipv4.tcp_slow_start_after_idle`` (per namespace; the kernel's default is on).

        On, a connection that was idle for longer than its retransmission timeout starts its next burst from
        the initial congestion window again: a training step's burst after compute then pays slow start's
        round trips. Applies to open connections too (the kernel reads it at each send).
        """
        for k in range(self.nodes):
            _run(["ip", "netns", "exec", self.ns(k), "sysctl", "-qw",
                  f"net.ipv4.tcp_slow_start_after_idle={int(enabled)}"])

    def delay_cpu_s(self) -> float:
        """CPU seconds the delay lines have used so far (their share of the machine's cores)."""
        total = 0.0
        for p in self._delay_lines:
            with contextlib.suppress(OSError), open(f"/proc/{p.pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
                total += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        return total

    def close(self) -> None:
        """Kill every process we started (and anything else left inside), delete all our namespaces.

        Idempotent; safe to call from signal handlers' unwinding and from ``atexit``.
        """
        if self._closed or not self._up:
            return
        with _signals_blocked():
            self.kill_processes(keep_delay_lines=False)
            for ns in reversed(self._created):  # nodes first, bridge last
                try:
                    _delete_ns(ns)
                except Exception as e:  # keep going: better to remove the others than stop half-way
                    print(f"warning: could not delete namespace {ns}: {e}", file=sys.stderr)
            self._created.clear()
            self._closed = True
            with _live_lock:
                if self in _live:
                    _live.remove(self)

    # -- processes ---------------------------------------------------------------------------------------
    def popen(
        self,
        k: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside node ``k``'s namespace (``ip netns exec``), in a new session.

        The process is tracked and killed on teardown. ``kwargs`` go to ``subprocess.Popen``.
        """
        if not self._up or self._closed:
            raise RuntimeError("cluster is not up")
        proc: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            ["ip", "netns", "exec", self.ns(k), *argv],
            env=dict(env) if env is not None else None,
            start_new_session=True,
            **kwargs,
        )
        self._procs.append(proc)
        return proc

    def kill_processes(self, grace: float = 5.0, *, keep_delay_lines: bool = True) -> None:
        """SIGTERM our process groups, wait ``grace`` s, then SIGKILL anything still in the namespaces
        (but the delay lines, unless ``keep_delay_lines`` is false: the cluster outlives a failed run)."""
        keep = [p.pid for p in self._delay_lines if p.poll() is None] if keep_delay_lines else []
        running = [p for p in self._procs if p.poll() is None and p.pid not in keep]
        for p in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        for p in running:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for ns in self._created:
            _kill_ns_processes(ns, grace=1.0, keep=keep)
        for p in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=2.0)
        self._procs = [p for p in self._procs if p.poll() is None]

    # -- counters ----------------------------------------------------------------------------------------
    def _stat(self, k: int, name: str) -> int:
        path = f"/sys/class/net/{self.iface(k)}/statistics/{name}"
        return int(_run(["ip", "netns", "exec", self.ns(k), "cat", path]).strip())

    def tx_bytes(self, k: int) -> int:
        """Bytes node ``k`` has sent on its link (Ethernet frames, headers included)."""
        return self._stat(k, "tx_bytes")

    def rx_bytes(self, k: int) -> int:
        """Bytes node ``k`` has received on its link."""
        return self._stat(k, "rx_bytes")


# -- torchrun launcher ---------------------------------------------------------------------------------


@dataclasses.dataclass
class NodeResult:
    """Outcome of one node's torchrun."""

    node: int
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    """Still running when we gave up on it (timeout, or another node failed) and killed it."""


def report_failures(results: Sequence[NodeResult], what: str, *, keep_going: bool, stdout_tail: int = 0,
                    stderr_tail: int = 4000) -> None:
    """Print the output tails of the nodes whose torchrun failed or timed out, then stop the benchmark
    with ``what`` in the message unless ``keep_going``."""
    bad = [r for r in results if r.returncode != 0 or r.timed_out]
    for r in bad:
        out = f"{r.stdout[-stdout_tail:]}\n" if stdout_tail else ""
        print(f"--- node {r.node}: rc={r.returncode} timed_out={r.timed_out}\n{out}{r.stderr[-stderr_tail:]}",
              file=sys.stderr)
    if bad and not keep_going:
        raise SystemExit(f"torchrun failed on {what}")


def node_env(cluster: EmulatedCluster, k: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a process on node ``k``: gloo bound to the node's veth, one thread per process.

    One thread because all emulated nodes share the machine's few cores; more threads would only add
    contention noise to the timings.
    """
    env = dict(os.environ)
    env.update(
        GLOO_SOCKET_IFNAME=cluster.iface(k),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        NUMBA_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    if extra:
        env.update(extra)
    return env


def run_torchrun(
    cluster: EmulatedCluster,
    script: str,
    script_args: Sequence[str] = (),
    *,
    master_port: int = 29500,
    timeout: float = 600.0,
    extra_env: Mapping[str, str] | None = None,
    fail_grace: float = 20.0,
    nproc_per_node: int = 1,
) -> list[NodeResult]:
    """Run ``torchrun --nnodes=N --node_rank=k --nproc_per_node=L script args`` in every namespace.

    With ``L > 1`` the ranks of a node reach each other over the node's own addresses (the kernel
    delivers those on the namespace's loopback, unshaped), and other nodes over the shaped link: a
    node of several GPUs on a fast local interconnect, behind one slow NIC.

    Returns one ``NodeResult`` per node (stdout/stderr captured to temp files, so full pipes cannot
    deadlock us). Everything is killed when ``timeout`` seconds pass, or ``fail_grace`` seconds after
    the first node fails (the others would otherwise wait for it until gloo's own timeout).
    """
    argv_base = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={cluster.nodes}", f"--nproc_per_node={nproc_per_node}", "--max_restarts=0",
        f"--master_addr={cluster.node_ip(0)}", f"--master_port={master_port}",
    ]
    procs: list[subprocess.Popen[bytes]] = []
    files: list[tuple[tempfile._TemporaryFileWrapper[bytes], tempfile._TemporaryFileWrapper[bytes]]] = []
    try:
        for k in range(cluster.nodes):
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            files.append((out, err))
            argv = [*argv_base, f"--node_rank={k}", script, *script_args]
            procs.append(cluster.popen(k, argv, node_env(cluster, k, extra_env), stdout=out, stderr=err))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]  # poll every one: returncode is only set by poll()
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, now + fail_grace)
            if now > deadline:
                break
            time.sleep(0.1)
    finally:
        killed = [p.poll() is None for p in procs]
        if any(killed):
            cluster.kill_processes()
    results = []
    for k, (p, (out, err)) in enumerate(zip(procs, files, strict=True)):
        out.seek(0)
        err.seek(0)
        results.append(NodeResult(k, p.returncode, out.read().decode(errors="replace"),
                                  err.read().decode(errors="replace"), killed[k]))
        out.close()
        err.close()
    return results


# -- self test -----------------------------------------------------------------------------------------

_SINK = """
import socket, sys, threading, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 29400)); s.listen(1); c, _ = s.accept(); n = 0; t0 = None
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(20): c.sendall(c.recv(1))  # the source's round trips
def back():  # --both-ways: as many bytes the other way on the same connection, at the same time
    buf = b"y" * (1 << 20)
    for _ in range(int(sys.argv[2])): c.sendall(buf)
    c.shutdown(socket.SHUT_WR)
t = threading.Thread(target=back); t.start()
while True:
    b = c.recv(1 << 20)
    if not b: break
    t0 = t0 or time.perf_counter(); n += len(b)
print(n, n * 8 / (time.perf_counter() - t0) / 1e9)
t.join()
"""

_SOURCE = """
import socket, sys, threading, time
for _ in range(100):
    try: c = socket.create_connection((sys.argv[1], 29400)); break
    except OSError: time.sleep(0.05)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(20):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
got = [0, None, None]
def recv():  # what the sink sends back (nothing one way)
    while True:
        b = c.recv(1 << 20)
        if not b: break
        got[1] = got[1] or time.perf_counter(); got[0] += len(b); got[2] = time.perf_counter()
t = threading.Thread(target=recv); t.start()
buf = b"x" * (1 << 20)
for _ in range(int(sys.argv[2])): c.sendall(buf)
c.shutdown(socket.SHUT_WR); t.join(); c.close()
print(min(rtts) * 1e3, got[0] * 8 / ((got[2] - got[1]) or 1) / 1e9 if got[0] else 0.0, flush=True)
"""


def selftest(rate: str | None, megabytes: int = 200, rtt_ms: float = 0.0, both_ways: bool = False) -> float:
    """Time 20 one-byte TCP round trips, then push ``megabytes`` MiB from node 1 to node 0 (with ``both_ways``
    as many from node 0 to node 1 on the same connection at the same time); return the achieved Gbit/s of the
    first direction."""
    with EmulatedCluster(2, rate=rate) as c:
        if rtt_ms:
            c.set_delay(rtt_ms)
        env = node_env(c, 0)
        back = str(megabytes if both_ways else 0)
        sink = c.popen(0, [sys.executable, "-c", _SINK, c.node_ip(0), back], env, stdout=subprocess.PIPE)
        time.sleep(0.3)
        tx0 = c.tx_bytes(1)
        src = c.popen(1, [sys.executable, "-c", _SOURCE, c.node_ip(0), str(megabytes)], node_env(c, 1),
                      stdout=subprocess.PIPE)
        out, _ = sink.communicate(timeout=300)
        src_out, _ = src.communicate(timeout=30)
        sent = c.tx_bytes(1) - tx0
        nbytes, gbps = out.decode().split()
        rtt, back_gbps = src_out.decode().split()
        delay = f", delay lines {c.delay_cpu_s():.2f} CPU s" if rtt_ms else ""
        other = f", {float(back_gbps):.3f} Gbit/s the other way at the same time" if both_ways else ""
        print(f"rate={rate} rtt={rtt_ms:g} ms: round trip {float(rtt):.2f} ms (min of 20), "
              f"{int(nbytes) / 2**20:.0f} MiB payload, {sent / 2**20:.0f} MiB on the link, "
              f"{float(gbps):.3f} Gbit/s{other}{delay}")
        return float(gbps)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``--cleanup`` removes stale namespaces; ``--selftest`` measures round trip and raw link throughput."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cleanup", action="store_true", help="delete namespaces left by dead runs")
    ap.add_argument("--all", action="store_true", help="with --cleanup: also those of live processes")
    ap.add_argument("--selftest", nargs="*", metavar="RATE",
                    help="TCP round trip and throughput between 2 emulated nodes at each RATE ('none' = unshaped)")
    ap.add_argument("--rtt", type=float, default=0.0, help="with --selftest: round-trip delay in ms (set_delay)")
    ap.add_argument("--megabytes", type=int, default=200, help="with --selftest: MiB to push")
    ap.add_argument("--both-ways", action="store_true",
                    help="with --selftest: push as many MiB back on the same connection at the same time")
    args = ap.parse_args(argv)
    if args.cleanup:
        removed = cleanup_stale(include_live_owners=args.all)
        print(f"removed {len(removed)} namespace(s)")
    if args.selftest is not None:
        for rate in args.selftest or ["1gbit", "10gbit", "none"]:
            selftest(None if rate == "none" else rate, args.megabytes, args.rtt, args.both_ways)
    if not args.cleanup and args.selftest is None:
        ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
