"""The emulated cluster's round-trip delay (benchmarks/netns_cluster.py + delay_line.py), as the time-to-accuracy
benchmark uses it: two nodes in their own namespaces, each node's egress held in a user-space delay line, so a
TCP round trip between them takes the configured time; a failed run's clean-up leaves the delay lines in place
and closing the cluster removes everything."""

import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import netns_cluster as nc  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc") or not os.path.exists("/dev/net/tun"),
    reason="needs root, iproute2 and /dev/net/tun")

_PING = """
import socket, sys, time
mode, addr = sys.argv[1], sys.argv[2]
if mode == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, 29411)); s.listen(1)
    print("listening", flush=True)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (b := c.recv(1)):
        c.sendall(b)
else:
    c = socket.create_connection((addr, 29411), timeout=10); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(5):
        t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
    print(min(rtts) * 1e3)
"""


def _round_trip_ms(cluster: nc.EmulatedCluster) -> float:
    server = cluster.popen(0, [sys.executable, "-c", _PING, "server", cluster.node_ip(0)], stdout=subprocess.PIPE)
    try:
        ready, _, _ = select.select([server.stdout], [], [], 10.0)  # bounded: a server that died says nothing
        assert ready and server.stdout.readline().strip() == b"listening"
        client = cluster.popen(1, [sys.executable, "-c", _PING, "client", cluster.node_ip(0)], stdout=subprocess.PIPE)
        out, _ = client.communicate(timeout=30)
        assert client.returncode == 0
        return float(out)
    finally:
        server.kill()
        server.wait(timeout=10)


@pytest.mark.budget(30)
def test_delay_lines_give_the_round_trip_survive_a_failed_run_and_go_with_the_cluster():
    with nc.EmulatedCluster(2, rate="100mbit") as cluster:
        assert _round_trip_ms(cluster) < 10  # no delay yet: the veth's fraction of a millisecond
        cluster.set_delay(40.0)
        assert 40.0 <= _round_trip_ms(cluster) < 40.0 + 100  # the upper bound only catches a delay applied twice
        sent = nc._run(["ip", "netns", "exec", cluster.ns(1), "cat",
                        f"/sys/class/net/{nc.DELAY_IFACE}/statistics/tx_bytes"])
        assert int(sent) > 0  # the round trips went through node 1's delay line
        with pytest.raises(RuntimeError, match="already"):
            cluster.set_delay(40.0)
        cluster.kill_processes()  # what run_torchrun does after a failed node: the delay lines stay
        assert all(p.poll() is None for p in cluster._delay_lines)
        assert _round_trip_ms(cluster) >= 40.0
        lines, names = list(cluster._delay_lines), [cluster.ns(0), cluster.ns(1), cluster.bridge_ns]
    assert all(p.poll() is not None for p in lines)
    assert not set(names) & set(nc._ns_list())
    with pytest.raises(ValueError, match="rtt_ms"):
        nc.EmulatedCluster(2, rate=None).set_delay(0)
