"""A fixed one-way delay on a node's outgoing traffic, for kernels without ``tc netem``.

``netns_cluster.py`` shapes rate with ``tc tbf``; propagation delay is ``sch_netem``'s job, and kernels built
without it (no ``netem``, ``fq`` or ``etf`` qdisc, so no earliest-departure-time trick either) cannot add one in
the kernel. This process adds it in user space: it opens a TUN device inside a node's namespace, the node's
routes to the other nodes point into it, and every packet read from it is written back after ``delay`` ms.
Packets written to a TUN device enter the namespace as if received on it, and a policy rule routes what enters
from the TUN device out of the node's real (rate-shaped) link::

    app -> route to peer -> tun 'delay' -> [this process: hold delay ms] -> tun 'delay' -> rule iif delay
        -> table 100 -> veth vn<k> (tbf) -> bridge -> peer

Each node delays its own egress by half the round trip, so any two nodes see the full round trip.
Traffic between ranks of one node never leaves the node (the kernel delivers it on loopback) and is not delayed.

Cost: the TUN device is opened with ``IFF_VNET_HDR`` and TCP segmentation offload, so TCP hands over
super-packets of up to 64 KiB and the process moves a few thousand packets a second at 100 Mbit/s: a few
percent of a core (``EmulatedCluster.delay_cpu_s`` reports what it used).

Run by ``EmulatedCluster.set_delay`` (as ``python delay_line.py DEV DELAY_MS``, inside the namespace);
it prints ``ready`` once the device exists and exits on SIGTERM or when its standard input closes.
"""

from __future__ import annotations

import collections
import fcntl
import math
import os
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
_MAX_PACKET = 65536 + 64  # a GSO super-packet plus the virtio header


def open_tun(name: str) -> int:
    """A TUN device ``name`` in this process's namespace, with offloads so that TCP hands over super-packets."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR))
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    return fd


def run(name: str, delay_s: float) -> None:
    """Hold every packet read from ``name`` for ``delay_s`` seconds, then write it back, in order."""
    fd = open_tun(name)
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    print("ready", flush=True)
    held: collections.deque[tuple[float, bytes]] = collections.deque()
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    poll.register(sys.stdin.fileno(), select.POLLIN | select.POLLHUP)  # the parent's death closes it
    while not stop:
        now = time.monotonic()
        while held and held[0][0] <= now:
            os.write(fd, held.popleft()[1])
        wait_ms = None if not held else max(0, math.ceil((held[0][0] - now) * 1e3))
        for f, _ in poll.poll(wait_ms):
            if f != fd:
                return
        due = time.monotonic() + delay_s
        while True:  # drain what is queued: one due time for the batch keeps order and costs one clock read
            try:
                held.append((due, os.read(fd, _MAX_PACKET)))
            except BlockingIOError:
                break


if __name__ == "__main__":
    run(sys.argv[1], float(sys.argv[2]) / 1e3)
