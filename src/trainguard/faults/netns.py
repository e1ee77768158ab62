"""Hosts as Linux network namespaces on one machine, joined by a bridge (tests, benchmarks;
needs root).

Each host gets its own namespace with one interface ``eth0`` at ``10.<a>.<b>.<i+2>/24``;
the bridge in the root namespace holds ``.1`` (where a controller binds). Everything is
created by ``up()`` and removed by ``down()``: the hosts' processes are SIGKILLed, the
namespaces and the bridge deleted. Names carry this process's pid, so parallel runs and
leftovers of a crashed run never collide.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Hosts:
    """``n`` hosts (network namespaces) on a bridge; ``names``, ``addrs`` (IPv4, one each) and
    ``gateway`` (the bridge's address). ``up()`` creates them (raises
    subprocess.CalledProcessError, having removed what it made, when ``ip`` fails: not
    root?), ``cmd(i, argv)`` runs in host ``i``, ``down()`` removes everything (see the module
    docstring)."""

    def __init__(self, n: int) -> None:
        tag = f"{os.getpid() % 100000}{random.randrange(100)}"
        self.names = [f"tgh{tag}n{i}" for i in range(n)]
        self.bridge = f"tgb{tag}"
        taken = _ip("-o", "addr", check=False).stdout  # parallel runs: a subnet of our own
        free = [s for s in range(1, 250) if f" 10.213.{s}." not in taken]
        sub = random.choice(free or [random.randrange(1, 250)])
        self.prefix = f"10.213.{sub}"
        self.gateway = f"{self.prefix}.1"
        self.addrs = [f"{self.prefix}.{i + 2}" for i in range(n)]
        self._veths = [f"tgv{tag}{i}" for i in range(n)]

    def up(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for ns, veth, addr in zip(self.names, self._veths, self.addrs, strict=True):
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
                _ip("link", "set", f"{veth}p", "netns", ns)
                _ip("-n", ns, "link", "set", f"{veth}p", "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
        except BaseException:
            self.down()
            raise
        return self

    def cmd(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``i``'s namespace."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def pids(self, i: int) -> list[int]:
        out = _ip("netns", "pids", self.names[i], check=False).stdout
        return [int(x) for x in out.split()]

    def kill_all(self, i: int) -> list[int]:
        """SIGKILL every process of host ``i`` (its power cord pulled). Returns the pids."""
        pids = self.pids(i)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down (its processes live on, unreachable)."""
        _ip("-n", self.names[i], "link", "set", "eth0", "down")

    def relink(self, i: int) -> None:
        """Bring host ``i``'s link back up."""
        _ip("-n", self.names[i], "link", "set", "eth0", "up")

    def partition(self, i: int, j: int) -> None:
        """Cut hosts ``i`` and ``j`` off from each other only: a blackhole route to the other's
        address in each namespace (packets dropped without an error, as on a failed switch
        port; established connections stall until their timeouts). Both still reach the
        bridge's ``.1`` and every other host."""
        _ip("-n", self.names[i], "route", "add", "blackhole", f"{self.addrs[j]}/32")
        _ip("-n", self.names[j], "route", "add", "blackhole", f"{self.addrs[i]}/32")

    def unpartition(self, i: int, j: int) -> None:
        """Undo ``partition(i, j)``."""
        _ip("-n", self.names[i], "route", "del", "blackhole", f"{self.addrs[j]}/32", check=False)
        _ip("-n", self.names[j], "route", "del", "blackhole", f"{self.addrs[i]}/32", check=False)

    def down(self) -> None:
        for i, ns in enumerate(self.names):
            for _ in range(50):
                if not self.kill_all(i):
                    break
                subprocess.run(["sleep", "0.1"], check=False)
            _ip("netns", "del", ns, check=False)
        for veth in self._veths:
            _ip("link", "del", veth, check=False)
        _ip("link", "del", self.bridge, check=False)
