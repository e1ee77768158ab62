"""The real controller under thousands of simulated agents (issue 14).

For each size in ``--nodes`` (default 1024,4096,16384) this starts a real ``trainguard
controller`` process (its real HTTP server, store and state machine) for a job of that many
nodes plus one standby, 8 workers per node, and ``--procs`` simulator processes. Each runs
one asyncio client per simulated node that speaks the real protocol (HTTP/1.1, JSON) over a
kept-alive connection of its own: it reports at the job's heartbeat interval (random phase),
starts its 8 workers when the controller says run (steps advancing with each report, each
report carrying its ranks' new step records, as a training agent's do), acks stops.

Per size it prints:
- controller CPU (cores, from /proc/PID/stat over ``--measure-s`` of steady training),
  its resident memory, p50/p99 report latency seen by the agents;
- a node killed mid-run (its agent stops reporting): the delay from its last heartbeat to
  the controller's fault decision, and from then to the standby's generation start;
- with ``--restart``: the controller SIGKILLed mid-run and started again on the run dir:
  when the simulated agents (the agent's jittered back-off) were all back, and a check from
  the events that the job did not restart and nothing was decided on stale observations.

With relays (``--relays``, default one per ``RACK_NODES`` nodes; issue 31) real
``trainguard relay`` processes stand in front of the controller: the simulated nodes of each
rack report to their relay (and fall back to the controller as the agent does), the
controller takes only the relays' uplinks; after the steady window the last relay is
SIGKILLed: its nodes must report directly within the node timeout and no node may be lost.

The heartbeat and node timeout are the controller's own, as its run orders carry them to
the agents (the simulators adopt them, as the agent does). Targets (issues 14 and 31): a
heartbeat <= 2 s and a node timeout <= 10 s at every size, steady p99 report latency
<= 100 ms, a lost node decided within its node timeout + 1 s, the controller within one
core; a relay killed causes no false node loss and its nodes are back within the node timeout.

Keys: ``sizes``, one entry a size: ``nodes``, ``workers``, ``heartbeat_s``,
``node_timeout_s``, ``join_s``, ``controller_cores``, ``controller_rss_mb``,
``report_p50_ms``, ``report_p99_ms``, ``reports``, ``steady_report_p50_ms``,
``steady_report_p99_ms``, ``controller_side``, ``fault``, ``fault_node``,
``detect_after_last_heartbeat_s``, ``replacement_decided_s``, ``replaced_by``, ``relays``,
``relay_cores`` (all relays' CPU together), ``relay_kill`` (with relays: ``nodes``,
``all_back_s``, ``nodes_back_p50_s``, ``nodes_back_last_s``, ``false_node_loss``,
``relay_lost_said_s``) and ``controller_restart`` with ``--restart``.

``--smoke``: 32 nodes, one simulator process, a 0.2 s heartbeat and a 2 s node timeout, 2 s
measured (CI). ``--record`` writes ``benchmarks/results/controller_scale.json``
(``table_rows``). Run: ``python benchmarks/controller_scale.py --nodes 1024 [--json]``.
Needs no GPU; everything runs on this machine's loopback and is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
from node_recovery import wait_until  # beside this file

from trainguard.agent.link import RELAY_RETRY_S, RELAY_TIMEOUT_S, backoff_after
from trainguard.controller.config import scaled_timing
from trainguard.runtime import wire
from trainguard.runtime.wire import receive_buffer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "gpt" / "train.py"
NPROC = 8
VICTIM = 7  # the node killed mid-run: a running one (node ranks follow names)
# Nodes per simulated rack (one relay process each). A real rack is smaller (16-64 nodes);
# here every relay is a process on the same 2 cores, and the controller's uplink rate is
# bounded whatever their number (server.py RELAY_UPLINKS_PER_S).
RACK_NODES = 512


def _sim(
    addr: str,
    token: str,
    nodes: list[int],
    heartbeat_s: float,
    kill: Any,
    killed_at: Any,
    back: Any,
    epoch: Any,
    stop: Any,
    out: Any,
    timing: Any,
    relays: list[str],
    total: int,
    relay_epoch: Any,
    relay_back: Any,
) -> None:
    """One simulator process: an asyncio client per node of ``nodes``. A node whose report
    fails retries with the agent's jittered back-off (``link.backoff_after``); ``back``
    counts nodes whose first report sent after ``epoch`` (wall time of a controller kill)
    succeeded. A node reports every ``heartbeat_s`` until a run order carries the
    controller's heartbeat, then at that one; ``timing`` (heartbeat_s, node_timeout_s) holds
    the run order's. With ``relays``, node ``i`` reports through ``relays[i * R // total]``
    (racks of consecutive nodes) and falls back to the controller as the agent does
    (``agent/link.py`` ``RoutedLink``): ``relay_back`` counts the nodes of a killed relay whose
    first report after ``relay_epoch`` (wall time of the kill) succeeded."""
    _raise_fd_limit()
    latencies: list[tuple[float, float]] = []  # (wall time sent, seconds to the answer)
    returned: list[float] = []  # wall time each node reported again after an outage
    relay_returned: list[float] = []  # the same after its relay was killed

    host, _, port = addr.rpartition(":")
    key_bytes = bytes.fromhex(token)
    acks: dict[str, asyncio.Future[dict[str, Any]]] = {}  # node → its pending alive ack
    udp: dict[str, asyncio.DatagramTransport] = {}  # relay → a socket connected to it

    class Acks(asyncio.DatagramProtocol):
        """One relay's acks. A connected socket hears of a dead relay (ICMP port unreachable)
        as the agent's does: each alive datagram waiting on it fails at once."""

        def __init__(self, relay: str) -> None:
            self.relay = relay

        def datagram_received(self, data: bytes, _addr: tuple[str, int]) -> None:
            with contextlib.suppress(ValueError):
                ack = wire.decode(key_bytes, data)
                fut = acks.pop(str(ack.get("node")), None)
                if fut is not None and not fut.done():
                    fut.set_result(ack)

        def error_received(self, exc: Exception) -> None:
            for nid, fut in list(acks.items()):
                if nid in waiting.get(self.relay, ()) and not fut.done():
                    fut.set_exception(ConnectionRefusedError(f"relay {self.relay}: {exc}"))

    debug: dict[str, Any] | None = {} if os.environ.get("TG_SCALE_DEBUG") else None
    last_ok: dict[str, tuple[float, str]] | None = {} if debug is not None else None
    waiting: dict[str, set[str]] = {}  # relay → nodes whose alive datagram awaits its ack
    gen_of: dict[str, int | None] = {}  # node → the generation it trains in (step records)

    async def alive(nid: str, inc: str, workers: list[int], step: int, to: str) -> dict[str, Any]:
        """As the agent's RoutedLink: an alive datagram to relay ``to``, its ack (2 s)."""
        if to not in udp:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.connect(_host_port(to))
            receive_buffer(sock)  # a rack's acks arrive together, as at the relay
            udp[to], _ = await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: Acks(to), sock=sock
            )
        fut = asyncio.get_running_loop().create_future()
        acks[nid] = fut
        waiting.setdefault(to, set()).add(nid)
        now = time.time()
        entry = [nid, inc, 0.0, [now, None],
                 [[r, step, 0.1, 0.1, None, None, None, None, None] for r in workers]]  # fmt: skip
        if workers and gen_of.get(nid) is not None:  # a training node: its step records too
            entry.append([{"generation": gen_of[nid], "rank": r,
                           "items": [{"step": step, "t_end": now, "dur": 0.1}]} for r in workers])  # fmt: skip
        udp[to].sendto(wire.encode(key_bytes, {"alive": entry, "seq": step}))
        try:
            return await asyncio.wait_for(fut, RELAY_TIMEOUT_S)
        finally:
            acks.pop(nid, None)
            waiting[to].discard(nid)

    async def node(i: int) -> None:
        nid, inc = f"n{i}", f"inc{i}-{os.getpid()}"
        direct = conn = _Conn(host, int(port), token)
        via = relays[i * len(relays) // total] if relays else None
        rconn = _Conn(*_host_port(via), token) if via else None
        bad_until, seen_relay_epoch = 0.0, 0.0
        acked: tuple[Any, ...] | None = None  # the shape its relay took whole
        timeouts = 0  # relay attempts in a row that timed out
        gen: int | None = None
        stopped, step, rank = -1, 0, 0
        action, version = "idle", 0
        backoff, failed, seen_epoch = 0.1, False, 0.0
        key: tuple[Any, ...] = ()
        template = ""
        hb = heartbeat_s
        await asyncio.sleep(random.uniform(0, hb))
        while not stop.is_set():
            if kill.value == i:
                direct.close()
                if rconn is not None:
                    rconn.close()
                return  # this node is lost: it reports no more
            routed = rconn is not None and time.monotonic() >= bad_until
            conn = rconn if routed and rconn is not None else direct
            running = action == "run" and gen is not None
            step += 1 if running else 0
            if key != (action, gen, rank, stopped, version):
                # The report's JSON once per desired state, with marks for what changes
                # every report (steps, time): the simulators' CPU is left to the controller.
                key = (action, gen, rank, stopped, version)
                workers = [
                    {"rank": rank * NPROC + k, "local_rank": k, "pid": 1000 + k,
                     "state": "running", "step": STEP_MARK, "progress_age_s": 0.1,
                     "heartbeat_age_s": 0.1, "runtime": True}
                    for k in range(NPROC)
                ] if running else []  # fmt: skip
                gen_of[nid] = gen if running else None
                # A training node's every report carries its ranks' new step records, as the
                # agent's do: one step each since the last report.
                steps = [
                    {"generation": gen, "rank": rank * NPROC + k,
                     "items": [{"step": STEP_MARK, "t_end": TIME_MARK, "dur": 0.1}]}
                    for k in range(NPROC)
                ] if running else []  # fmt: skip
                template = json.dumps({
                    "v": 1, "node_id": nid, "addr": f"10.0.{i // 250}.{i % 250 + 1}",
                    "incarnation": inc, "generation": gen if action == "run" else None,
                    "desired_version": version,
                    "workers": workers, "stopped_generation": stopped, "events": [],
                    "steps": steps, "memory": {}, "replicas": {}, "time": TIME_MARK,
                    "store": [gen, 29500] if action == "run" and rank == 0 else None,
                })  # fmt: skip
            if debug is not None:
                debug[nid] = (action, version, stopped, routed, acked == key)
            t0, t_wall = time.monotonic(), time.time()
            if routed and via is not None and acked == key:  # only counters moved: a datagram
                try:
                    ack = await alive(nid, inc, [rank * NPROC + k for k in range(NPROC)]
                                      if running else [], step, via)  # fmt: skip
                except (OSError, TimeoutError) as e:  # as RoutedLink: a first timeout is
                    if isinstance(e, TimeoutError) and not timeouts:  # retried (back-off)
                        timeouts += 1
                        await asyncio.sleep(0.1)
                        continue
                    bad_until, acked = time.monotonic() + RELAY_RETRY_S, None
                    continue
                timeouts = 0
                if not ack.get("known") or int(ack.get("version", 0)) != version:
                    acked = None  # its shape or a new desired state: the whole report, now
                    continue
                latencies.append((t_wall, time.monotonic() - t0))
                if i == VICTIM:
                    killed_at.value = time.time()
                if last_ok is not None:
                    last_ok[nid] = (time.time(), "datagram")
                await asyncio.sleep(hb * random.uniform(0.9, 1.1))
                continue
            body = template.replace(str(STEP_MARK), str(step)).replace(
                repr(TIME_MARK), repr(t_wall)
            )
            try:
                reply = await conn.post(
                    "/v1/report", body.encode(), timeout_s=RELAY_TIMEOUT_S if routed else 30.0
                )
                latencies.append((t_wall, time.monotonic() - t0))
                acked, timeouts = (key if routed else None), 0
                if last_ok is not None:
                    last_ok[nid] = (time.time(), "relay" if routed else "direct")
                if (relay_epoch.value and t_wall > relay_epoch.value
                        and seen_relay_epoch != relay_epoch.value):  # fmt: skip
                    seen_relay_epoch = relay_epoch.value
                    if via is not None and via == relays[-1]:  # the killed one's node
                        relay_returned.append(time.time())
                        with relay_back.get_lock():
                            relay_back.value += 1
                if failed:
                    failed, backoff = False, 0.1
                if epoch.value and t_wall > epoch.value and seen_epoch != epoch.value:
                    seen_epoch = epoch.value  # its first report sent after the restart
                    returned.append(time.time())
                    with back.get_lock():
                        back.value += 1
                if i == VICTIM:
                    killed_at.value = time.time()  # its last report the controller took
                if "desired" not in reply:  # unchanged since the last reply
                    await asyncio.sleep(hb * random.uniform(0.9, 1.1))
                    continue
                version, d = int(reply["version"]), reply["desired"]
                action = d.get("action", "idle")
                if action == "run":
                    gen, rank = int(d["generation"]), int(d["node_rank"])
                    hb = float(d.get("heartbeat_s") or hb)  # the agent's: the order's
                    timing[0], timing[1] = hb, float(d.get("node_timeout_s") or 0.0)
                elif action == "stop":
                    stopped = int(d["generation"])
                elif action == "shutdown":
                    conn.close()
                    return
            except (OSError, EOFError, TimeoutError, ValueError, KeyError, IndexError) as e:
                if routed and isinstance(e, TimeoutError) and not timeouts:
                    timeouts += 1  # as RoutedLink: a first timeout is retried (back-off)
                    await asyncio.sleep(0.1)
                    continue
                if routed:  # as RoutedLink: directly for RELAY_RETRY_S, at once
                    bad_until = time.monotonic() + RELAY_RETRY_S
                    continue
                failed = True
                await asyncio.sleep(backoff)
                backoff = backoff_after(backoff)
                continue
            await asyncio.sleep(hb * random.uniform(0.9, 1.1))

    async def show() -> None:  # TG_SCALE_DEBUG: what the simulated nodes are doing
        assert debug is not None
        assert last_ok is not None
        while not stop.is_set():
            await asyncio.sleep(2)
            now = time.time()
            late = {n: (round(now - t, 1), how) for n, (t, how) in last_ok.items() if now - t > 5}
            if late:
                print(
                    f"sim {os.getpid()}: {len(late)} nodes without an answer for 5 s+, e.g.",
                    list(late.items())[:5],
                    file=sys.stderr,
                    flush=True,
                )
            if int(now) % 15 > 1:
                continue
            counts: dict[Any, int] = {}
            for v in debug.values():
                counts[v] = counts.get(v, 0) + 1
            print(
                f"sim {os.getpid()}: (action, version, stopped, routed, acked) counts",
                sorted(counts.items(), key=lambda kv: -kv[1])[:8],
                file=sys.stderr,
                flush=True,
            )

    async def main() -> None:
        if debug is not None:
            asyncio.get_running_loop().create_task(show())
        await asyncio.gather(*(node(i) for i in nodes))
        for transport in udp.values():
            transport.close()

    asyncio.run(main())
    out.put((latencies, returned, relay_returned))


STEP_MARK, TIME_MARK = 876543210, 1234567890.125  # replaced in each report's JSON


def _host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


class _Conn:
    """One kept-alive HTTP/1.1 connection that speaks what a report needs: a POST of a JSON
    body, a JSON answer with a Content-Length (what aiohttp's server sends). Several times
    cheaper per request than aiohttp's client, so that the simulators, on the same cores,
    leave the CPU to the controller they measure. Raises OSError, EOFError (closed
    mid-answer), TimeoutError or ValueError (an error status, bad JSON)."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port = host, port
        self._auth = f"Authorization: Bearer {token}\r\n"
        self._r: asyncio.StreamReader | None = None
        self._w: asyncio.StreamWriter | None = None

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
        self._r = self._w = None

    async def post(self, path: str, body: bytes, timeout_s: float) -> dict[str, Any]:
        try:
            return await asyncio.wait_for(self._post(path, body), timeout_s)
        except BaseException:
            self.close()  # a fresh connection next time
            raise

    async def _post(self, path: str, body: bytes) -> dict[str, Any]:
        if self._w is None:
            self._r, self._w = await asyncio.open_connection(self.host, self.port)
        assert self._r is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n{self._auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self._w.write(head.encode() + body)
        status = await self._r.readline()
        if not status:
            raise EOFError("connection closed")
        code, length, close = int(status.split()[1]), 0, False
        while (line := await self._r.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "connection" and value.strip().lower() == "close":
                close = True
        data = await self._r.readexactly(length)
        if close:
            self.close()
        if code >= 400:
            raise ValueError(f"HTTP {code}: {data[:200]!r}")
        return dict(json.loads(data))


def _died(sims: list[Any], ctl: subprocess.Popen[bytes], log: Path, run: Path) -> str:
    """Which process ended the measurement and why: each dead simulator's exit code (its
    traceback is above), the controller's exit status, its log's last lines and the job's
    last phase (a job failed while the nodes joined), read before the temp dir goes."""
    lines = [f"simulator {i} exited with {p.exitcode}" for i, p in enumerate(sims)
             if not p.is_alive()]  # fmt: skip
    if ctl.poll() is not None:
        lines.append(f"the controller exited with {ctl.returncode}; its log ends:")
        with contextlib.suppress(OSError):
            lines += log.read_text(errors="replace").splitlines()[-15:]
        with contextlib.suppress(OSError, ValueError):
            phases = [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
                      if e.get("kind") in ("phase", "job_failed")]  # fmt: skip
            lines += [f"the job's last phase event: {phases[-1]}"] if phases else []
    return "\n".join(lines) or "a simulator or the controller died"


def _raise_fd_limit() -> None:
    """One socket per simulated node (and per node in the controller): the soft fd limit up
    to the hard one."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _scrape(addr: str, token: str) -> dict[str, list[tuple[float, float]]]:
    """Cumulative histogram buckets (upper bound s, count) of the controller's
    ``trainguard_report_handling_seconds`` and ``trainguard_tick_seconds``, parsed with
    prometheus_client's text parser."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(
        f"http://{addr}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[float, float]]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in ("trainguard_report_handling_seconds", "trainguard_tick_seconds"):
            out[fam.name] = [
                (float(x.labels["le"]), x.value) for x in fam.samples if x.name.endswith("_bucket")
            ]
    return out


def _bucket_q(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> str:
    """The ``q`` quantile between two scrapes as the histogram bucket holding it ("<= X ms")."""
    prev = dict(before)
    counts = [(le, c - prev.get(le, 0.0)) for le, c in after]
    total = counts[-1][1] if counts else 0.0
    for le, c in counts:
        if total and c >= q * total:
            return f"<={le * 1000:g} ms" if le != float("inf") else "> 1 s"
    return "n/a"


def _ms(sorted_s: list[float], q: float) -> float | None:
    """The ``q`` quantile of sorted seconds, in milliseconds (nearest rank)."""
    return round(1000 * sorted_s[int(q * (len(sorted_s) - 1))], 1) if sorted_s else None


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _events(run: Path) -> list[dict[str, Any]]:
    out = []
    for line in (run / "events.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            out.append(json.loads(line))
    return out


def measure(
    n: int,
    procs: int,
    measure_s: float,
    heartbeat_s: float | None,
    restart: bool,
    node_timeout_s: float | None = None,
    relays: int = 0,
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="tg-scale-"))
    run = tmp / "run"
    cfg = tmp / "job.toml"
    cfg.write_text(
        f'preflight = "off"\nrelays = {relays}\n'
        + (f"heartbeat_s = {heartbeat_s}\n" if heartbeat_s else "")
        + (f"node_timeout_s = {node_timeout_s}\n" if node_timeout_s else "")
    )
    # Until the first run order says the controller's own: the scale rule (nodes + standby).
    hb_start = heartbeat_s or scaled_timing(n + 1, relays)[0]
    log = open(tmp / "controller.log", "w")  # noqa: SIM115 - closed with the process below
    cmd = [sys.executable, "-m", "trainguard", "controller", "--bind", "127.0.0.1:0",
           "--run-dir", str(run), "--config", str(cfg), "--nodes", str(n), "--standby", "1",
           "--nproc-per-node", str(NPROC), str(SCRIPT)]  # fmt: skip

    started: list[subprocess.Popen[bytes]] = []  # every controller, killed at the end

    def start_controller() -> subprocess.Popen[bytes]:
        started.append(
            subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT, preexec_fn=_raise_fd_limit
            )
        )
        return started[-1]

    ctl = start_controller()
    relay_procs: list[subprocess.Popen[bytes]] = []  # every relay, killed at the end
    sims: list[mp.Process] = []
    stop = mp.Event()
    try:
        wait_until(lambda: (run / "controller.json").exists() and (run / "token").exists(), 60,
                     "the controller")  # fmt: skip
        addr = json.loads((run / "controller.json").read_text())["addr"]
        token = (run / "token").read_text().strip()
        timing = mp.Array("d", [0.0, 0.0])  # (heartbeat_s, node_timeout_s) of the run orders
        kill, killed_at = mp.Value("i", -1), mp.Value("d", 0.0)  # victim's last report (wall)
        back, epoch = mp.Value("i", 0), mp.Value("d", 0.0)
        out: mp.Queue[tuple[list[float], list[float], list[float]]] = mp.Queue()
        relay_epoch, relay_back = mp.Value("d", 0.0), mp.Value("i", 0)
        relay_addrs = [_start_relay(addr, run / "token", k, tmp, relay_procs)
                       for k in range(relays)]  # fmt: skip
        ids = list(range(n + 1))
        for k in range(procs):
            p = mp.Process(
                target=_sim,
                args=(
                    addr,
                    token,
                    ids[k::procs],
                    hb_start,
                    kill,
                    killed_at,
                    back,
                    epoch,
                    stop,
                    out,
                    timing,
                    relay_addrs,
                    n + 1,
                    relay_epoch,
                    relay_back,
                ),
                daemon=True,
            )
            p.start()
            sims.append(p)

        read = [0]  # how far events.jsonl was read: the join's thousands of events once each

        def running() -> bool:
            if not all(p.is_alive() for p in sims) or ctl.poll() is not None:
                raise SystemExit(_died(sims, ctl, tmp / "controller.log", run))
            with open(run / "events.jsonl", "rb") as f:
                f.seek(read[0])
                chunk = f.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]  # complete lines only
            read[0] += len(whole)
            return any(e.get("kind") == "phase" and e.get("to") == "RUNNING"
                       for e in map(json.loads, whole.splitlines()) if e)  # fmt: skip

        t_join = time.monotonic()
        wait_until(running, 600, f"{n} nodes to join and run")
        join_s = time.monotonic() - t_join
        hb_eff, timeout_eff = wait_until(
            lambda: tuple(timing) if timing[0] > 0 and timing[1] > 0 else None, 60,
            "a run order's heartbeat and node timeout",
        )  # fmt: skip
        time.sleep(min(5.0, measure_s))  # settle
        h0 = _scrape(addr, token)
        c0, w0, steady_from = _cpu_s(ctl.pid), time.monotonic(), time.time()
        r0 = sum(_cpu_s(r.pid) for r in relay_procs)
        time.sleep(measure_s)
        cores = (_cpu_s(ctl.pid) - c0) / (time.monotonic() - w0)
        relay_cores = (sum(_cpu_s(r.pid) for r in relay_procs) - r0) / (time.monotonic() - w0)
        steady_to = time.time()
        h1 = _scrape(addr, token)
        rep, tick = "trainguard_report_handling_seconds", "trainguard_tick_seconds"
        server_side = {
            "report_handling_p50": _bucket_q(h0[rep], h1[rep], 0.5),
            "report_handling_p99": _bucket_q(h0[rep], h1[rep], 0.99),
            "tick_p50": _bucket_q(h0[tick], h1[tick], 0.5),
            "tick_p99": _bucket_q(h0[tick], h1[tick], 0.99),
        }
        rss = _rss_mb(ctl.pid)
        after_restart: dict[str, Any] = {}
        if restart:
            ctl, after_restart = _restart(
                ctl, start_controller, run, n + 1, back, epoch, timeout_eff
            )
        relay_kill = (
            _kill_relay(relay_procs[-1], run, relay_epoch, relay_back,
                        sum(1 for i in ids if i * relays // (n + 1) == relays - 1), timeout_eff)
            if relays
            else None
        )  # fmt: skip
        victim = VICTIM
        kill.value = victim
        fault = wait_until(
            lambda: next((e for e in _events(run) if e["kind"] == "fault"), None),
            timeout_eff * 4 + 60, "the fault decision",
        )  # fmt: skip
        if fault.get("node_id") != f"n{victim}":  # a false node loss: no figure to give
            raise SystemExit(f"a node that was not stopped was decided lost: {fault}")
        detect_s = float(fault["t_detected"]) - killed_at.value

        def gen1() -> dict[str, Any] | None:
            return next(
                (e for e in _events(run) if e["kind"] == "generation_started"
                 and e["generation"] == 1), None,
            )  # fmt: skip

        g1 = wait_until(gen1, 300, "the standby's generation")
        g0 = next(e for e in _events(run) if e["kind"] == "generation_started")
        replace_s = float(g1["ts"]) - float(fault["t_detected"])
        stop.set()
        sent: list[tuple[float, float]] = []
        returned: list[float] = []
        relay_returned: list[float] = []
        for _ in sims:
            got_lat, got_back, got_relay_back = out.get(timeout=120)
            sent += got_lat
            returned += got_back
            relay_returned += got_relay_back
        if relay_kill is not None:
            spread = sorted(t - relay_kill["t_kill"] for t in relay_returned)
            relay_kill["nodes_back_p50_s"] = round(statistics.median(spread), 2) if spread else None
            relay_kill["nodes_back_last_s"] = round(spread[-1], 2) if spread else None
            relay_kill.pop("t_kill")
        lat = sorted(d for _, d in sent)
        steady = sorted(d for t, d in sent if steady_from <= t <= steady_to)
        if os.environ.get("TG_SCALE_DEBUG"):
            slow = sorted(round(t - steady_from, 1) for t, d in sent if d > 0.3)
            print(
                "slow reports at (s from steady start):",
                slow[:: max(1, len(slow) // 40)],
                "fault at",
                round(float(fault["t_detected"]) - steady_from, 1),
                file=sys.stderr,
            )
        if restart and returned:
            t_up = after_restart.pop("t_up")
            spread = sorted(t - t_up for t in returned if t >= t_up)
            after_restart["nodes_back_first_s"] = round(spread[0], 2) if spread else None
            after_restart["nodes_back_p50_s"] = (
                round(statistics.median(spread), 2) if spread else None
            )
            after_restart["nodes_back_last_s"] = round(spread[-1], 2) if spread else None
        return {
            "nodes": n,
            "workers": n * NPROC,
            "heartbeat_s": hb_eff,
            "node_timeout_s": timeout_eff,
            "join_s": round(join_s, 1),
            "controller_cores": round(cores, 3),
            "relays": relays,
            "relay_cores": round(relay_cores, 3),
            "controller_rss_mb": round(rss, 1),
            "report_p50_ms": _ms(lat, 0.5),
            "report_p99_ms": _ms(lat, 0.99),
            "reports": len(lat),
            # over the measured window of steady training only (no join, restart or fault)
            "steady_report_p50_ms": _ms(steady, 0.5),
            "steady_report_p99_ms": _ms(steady, 0.99),
            # the controller's own histograms over the same window (bucket bounds)
            "controller_side": server_side,
            "fault": fault["cause"],
            "fault_node": fault["node_id"],
            "detect_after_last_heartbeat_s": round(detect_s, 2),
            "replacement_decided_s": round(replace_s, 2),
            "replaced_by": sorted(set(g1["assignment"]) - set(g0["assignment"])),
            **({"controller_restart": after_restart} if restart else {}),
            **({"relay_kill": relay_kill} if relay_kill is not None else {}),
        }
    finally:
        stop.set()
        for p in sims:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        procs = [*started, *relay_procs]
        for c in procs:  # every one told first, then one deadline for all (33 relays at
            if c.poll() is None:  # 16,384 nodes, busy, took minutes one 60 s wait at a time)
                c.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30.0
        for c in procs:
            try:
                c.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
        log.close()
        if os.environ.get("TG_SCALE_KEEP"):  # debugging: the run dir and logs stay
            print(f"kept {tmp}", file=sys.stderr)
        else:
            subprocess.run(["rm", "-rf", str(tmp)], check=False)


def _start_relay(
    controller: str, token_file: Path, k: int, tmp: Path, procs: list[subprocess.Popen[bytes]]
) -> str:
    """Start ``trainguard relay`` number ``k`` (a real process on loopback) for the controller
    at ``controller``; its address once it listens (60 s deadline)."""
    log = open(tmp / f"relay{k}.log", "w")  # noqa: SIM115 - the process owns it
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard", "relay", "--controller", controller,
         "--token-file", str(token_file), "--bind", "127.0.0.1:0", "--relay-id", f"rack{k}"],
        stdout=subprocess.PIPE, stderr=log, cwd=ROOT, preexec_fn=_raise_fd_limit,
    )  # fmt: skip
    procs.append(proc)
    log.close()
    assert proc.stdout is not None
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        if line.startswith("relay listening on "):
            return line.split()[-1]
        if not line and proc.poll() is not None:
            break
    raise SystemExit(f"relay {k} did not start; see {tmp / f'relay{k}.log'}")


def _kill_relay(
    proc: subprocess.Popen[bytes],
    run: Path,
    epoch: Any,
    back: Any,
    nodes: int,
    timeout_s: float,
) -> dict[str, Any]:
    """SIGKILL a relay mid-run (its ``nodes`` fall back to the controller), wait one node
    timeout + 2 s, and check from the events that no node was lost and nothing restarted.
    Raises SystemExit on a false node loss."""
    t_kill = time.time()
    epoch.value = t_kill
    proc.kill()
    proc.wait()
    wait_until(lambda: back.value >= nodes, timeout_s * 3 + 30,
               "the killed relay's nodes to report directly")  # fmt: skip
    all_back = time.time() - t_kill
    time.sleep(max(0.0, t_kill + timeout_s + 2.0 - time.time()))
    after = [e for e in _events(run) if float(e["ts"]) >= t_kill]
    decided = [e["kind"] for e in after if e["kind"] in ("fault", "generation_started")]
    if decided:
        raise SystemExit(f"a relay's loss changed the job (false node loss): {decided}")
    lost = [float(e["ts"]) - t_kill for e in after if e["kind"] == "relay_lost"]
    return {"nodes": nodes, "all_back_s": round(all_back, 2), "false_node_loss": False,
            "relay_lost_said_s": round(lost[0], 2) if lost else None, "t_kill": t_kill}  # fmt: skip


def _restart(
    ctl: subprocess.Popen[bytes],
    start: Any,
    run: Path,
    total: int,
    back: Any,
    epoch: Any,
    timeout_s: float,
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """SIGKILL the controller mid-run and start it again on the same run dir (it resumes on
    the same port). Waits until every simulated node reported to the new one, then one node
    timeout more, and checks from the events that the job did not restart: no fault, no
    generation started, and no decision before every node was back."""
    ctl.kill()
    ctl.wait()
    t_kill = time.time()
    back.value, epoch.value = 0, t_kill
    new = start()
    wait_until(
        lambda: any(e["kind"] == "controller_restarted" for e in _events(run)), 120,
        "the restarted controller",
    )  # fmt: skip
    t_up = next(float(e["ts"]) for e in _events(run) if e["kind"] == "controller_restarted")
    wait_until(lambda: back.value >= total, 300, "every node to report to the new controller")
    t_all = time.time()
    time.sleep(timeout_s + 2.0)  # a decision on stale observations would have come by now
    after = [e for e in _events(run) if float(e["ts"]) >= t_kill]
    decided = [e["kind"] for e in after if e["kind"] in ("fault", "generation_started", "phase")]
    if decided:
        raise SystemExit(f"the restarted controller changed the job: {decided}")
    return new, {
        "down_s": round(t_up - t_kill, 2),
        "all_back_s": round(t_all - t_up, 2),
        "job_restarted": False,
        "t_up": t_up,
    }


TARGET_P99_MS = 100.0  # steady report latency, p99 (issue 14)
TARGET_HEARTBEAT_S, TARGET_NODE_TIMEOUT_S = 2.0, 10.0  # at every size (issue 31)
TARGET_CORES = 1.0  # the controller's CPU


def _size_target(row: dict[str, Any]) -> str:
    p99, timeout = row["steady_report_p99_ms"], row["node_timeout_s"]
    parts = [
        "heartbeat " + common.verdict(row["heartbeat_s"], TARGET_HEARTBEAT_S, " s"),
        "node timeout " + common.verdict(timeout, TARGET_NODE_TIMEOUT_S, " s"),
        "steady p99 "
        + (common.verdict(p99, TARGET_P99_MS, " ms") if p99 is not None else "not measured"),
        "lost node decided "
        + common.verdict(row["detect_after_last_heartbeat_s"], timeout + 1.0, " s",
                         "node timeout + 1 s"),
        "controller " + common.verdict(row["controller_cores"], TARGET_CORES, " core"),
    ]  # fmt: skip
    rk = row.get("relay_kill")
    if rk is not None:
        parts.append(
            ("no false node loss" if not rk["false_node_loss"] else "FALSE NODE LOSS")
            + "; its nodes back "
            + common.verdict(rk["nodes_back_last_s"] or 0.0, timeout, " s", "node timeout")
        )
    return "; ".join(parts)


def table_rows(result: dict[str, Any]) -> list[common.Row]:
    """The README's rows: one per size (the three largest measured), the steady latency, the
    lost node's decision and the controller's CPU against issue 14's targets."""
    rows: list[common.Row] = []
    for r in sorted(result["sizes"], key=lambda r: r["nodes"])[-3:]:
        p50, p99 = r["steady_report_p50_ms"], r["steady_report_p99_ms"]
        restart = r.get("controller_restart")
        rows.append(
            {
                "what": (
                    f"controller at {r['nodes']:,} simulated nodes ({r['workers']:,} workers"
                    + (f", {r['relays']} relays" if r.get("relays") else ", no relays")
                    + "; "
                    f"heartbeat {r['heartbeat_s']:g} s, node timeout {r['node_timeout_s']:g} s): "
                    "the real controller process, agents simulated on loopback"
                ),
                "result": (
                    f"steady report p50 {p50 if p50 is not None else 'n/a'} ms, p99 "
                    f"{p99 if p99 is not None else 'n/a'} ms ("
                    + (  # through relays every report reaches it in an uplink: no direct one
                        f"handling p99 {r['controller_side']['report_handling_p99']}, "
                        if r["controller_side"]["report_handling_p99"] != "n/a"
                        else ""
                    )
                    + f"tick p99 {r['controller_side']['tick_p99']}); controller "
                    f"{r['controller_cores']:.2f} cores, {r['controller_rss_mb']:.0f} MB; lost "
                    f"node decided {r['detect_after_last_heartbeat_s']:.1f} s after its last "
                    f"heartbeat, standby generation {r['replacement_decided_s']:.1f} s later"
                    + (
                        f"; {r['relays']} relays ({r['relay_cores']:.2f} cores), one SIGKILLed: "
                        f"its {r['relay_kill']['nodes']} nodes reported directly within "
                        f"{r['relay_kill']['nodes_back_last_s']} s, no node lost"
                        if r.get("relay_kill")
                        else ""
                    )
                    + (
                        f"; controller SIGKILLed and restarted: up in {restart['down_s']:.2f} s, "
                        f"every node back {restart['all_back_s']:.2f} s later, job untouched"
                        if restart
                        else ""
                    )
                ),
                "target": _size_target(r),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="1024,4096,16384", help="comma-separated sizes")
    p.add_argument("--procs", type=int, default=4, help="simulator processes")
    p.add_argument("--measure-s", type=float, default=20.0)
    p.add_argument("--heartbeat-s", type=float, default=None,
                   help="override the job's heartbeat (default: the controller's rule)")  # fmt: skip
    p.add_argument("--node-timeout-s", type=float, default=None,
                   help="override the job's node timeout (default: the controller's rule)")  # fmt: skip
    p.add_argument("--relays", default="auto",
                   help="trainguard relay processes (racks of consecutive nodes report through "
                   f"them; one is killed mid-run): N, 0 (agents report directly) or auto (one "
                   f"per {RACK_NODES} nodes; default)")  # fmt: skip
    p.add_argument("--restart", action="store_true",
                   help="also SIGKILL and restart the controller mid-run at each size")  # fmt: skip
    common.add_common(p, smoke="32 nodes, a 0.2 s heartbeat, 2 s measured (CI)")
    a = p.parse_args(argv)
    # A SIGTERM (timeout, Ctrl-C's cousin) ends the run through measure's clean-up: the
    # controller, relays and simulators it started are stopped, not left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.smoke:
        a.nodes, a.procs, a.measure_s, a.heartbeat_s, a.node_timeout_s = "32", 1, 2.0, 0.2, 2.0
        a.relays = "2" if a.relays == "auto" else a.relays
    if a.relays != "auto" and not a.relays.isdigit():
        p.error(f"--relays {a.relays}: a number of relays, 0 (none) or auto")
    try:
        sizes = [int(x) for x in a.nodes.split(",")]
    except ValueError:
        p.error(f"--nodes {a.nodes}: comma-separated numbers of nodes")
    if min(sizes) <= VICTIM or a.procs < 1 or a.measure_s <= 0:
        p.error(f"--nodes: each size > {VICTIM} (node {VICTIM} is lost mid-run); --procs >= 1; "
                "--measure-s > 0")  # fmt: skip
    rows = []
    for n in sizes:
        relays = -(-(n + 1) // RACK_NODES) if a.relays == "auto" else int(a.relays)
        row = measure(n, a.procs, a.measure_s, a.heartbeat_s, a.restart, a.node_timeout_s,
                      relays)  # fmt: skip
        rows.append(row)
        if not a.json:
            print(
                f"{row['nodes']:6d} nodes ({row['workers']} workers), heartbeat "
                f"{row['heartbeat_s']}s, timeout {row['node_timeout_s']}s: joined in "
                f"{row['join_s']}s; controller {row['controller_cores']} cores, "
                f"{row['controller_rss_mb']} MB; report p50 {row['report_p50_ms']} ms, p99 "
                f"{row['report_p99_ms']} ms (steady training: p50 {row['steady_report_p50_ms']}, "
                f"p99 {row['steady_report_p99_ms']} ms; in the controller: handling p99 "
                f"{row['controller_side']['report_handling_p99']}, tick p50 "
                f"{row['controller_side']['tick_p50']} p99 {row['controller_side']['tick_p99']}); "
                f"lost node decided {row['detect_after_last_heartbeat_s']}s "
                f"after its last heartbeat ({row['fault']}), standby generation "
                f"{row['replacement_decided_s']}s later",
                flush=True,
            )
            r = row.get("controller_restart")
            if r:
                print(
                    f"        controller SIGKILLed and restarted: up after {r['down_s']}s; nodes "
                    f"back after {r['nodes_back_first_s']}-{r['nodes_back_last_s']}s (p50 "
                    f"{r['nodes_back_p50_s']}s); every node back {r['all_back_s']}s after the "
                    "start; the job did not restart and no decision came before",
                    flush=True,
                )
    common.finish("controller_scale", a, {"sizes": rows}, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
