"""``trainguard check``: pre-flight node checks, on their own or against a live job.

- ``--nodes N`` (default 4): N simulated nodes on this machine (agents on 127.0.0.2…), as
  ``trainguard run`` makes them.
- ``--nodes N --bind HOST:PORT``: wait for N real agents (``trainguard agent --controller
  HOST:PORT --token-file RUN_DIR/token …`` on each host), check them, and let them exit.
- ``--controller HOST:PORT``: ask a job's controller to check its idle nodes now (nodes
  that train are not checked).

Prints progress while it runs, then the five node lists, a table of measurements per
node with each check's time, and every failed check with its reason; ``--json`` prints
the run as JSON on stdout instead (progress stays on stderr). Results are in the store (``RUN_DIR/job.sqlite``, events
``preflight_*``). Exit status: 0 when every node passed, 1 when any did not.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from trainguard.controller.config import JobConfig, PreflightConfig, TimeoutsConfig
from trainguard.controller.jobstate import pool_lists
from trainguard.controller.server import Controller
from trainguard.controller.store import Store
from trainguard.faults.inject import parse_inject
from trainguard.health.judge import CheckConfig
from trainguard.observe.console import console as make_console
from trainguard.observe.console import styled
from trainguard.observe.html import DASHBOARD

POLL_S = 0.5


def _check_config(args: argparse.Namespace) -> CheckConfig:
    from trainguard.cli.run import load_fields

    extra = load_fields(args.config, CheckConfig)
    if args.level is not None:
        extra["level"] = args.level
    try:
        return CheckConfig(**extra)
    except TypeError as e:
        raise ValueError(f"--config {args.config}: a field has the wrong type ({e})") from None


class Progress:
    """Prints what changed in a run since the last call (stage, nodes that answered)."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.seen: set[tuple[str, str]] = set()
        self.stage = ""

    def show(self, run: dict[str, Any]) -> None:
        t = time.time() - self.t0
        for stage in ("node", "net"):
            for n, times in run.get("answered", {}).get(stage, {}).items():
                if (stage, n) not in self.seen:
                    self.seen.add((stage, n))
                    took = ", ".join(f"{k} {v:.2f}s" for k, v in times.items())
                    self.say(t, f"  {n}: {took}")
        if run["stage"] != self.stage:
            self.stage = run["stage"]
            n_net = len(run.get("net_nodes") or [])
            what = {
                "node": f"host checks and GEMM on {len(run['nodes'])} node(s)",
                "net": "collectives in pairing rounds, then simulated training"
                if n_net != 1
                else "simulated training (one node: no partner for collectives)",
                "done": f"finished in {run.get('stage_s', {}).get('total', 0):.1f}s",
            }
            self.say(
                t, f"pre-flight {run['run']} ({run['level']}): {self.stage}: {what[self.stage]}"
            )

    @staticmethod
    def say(t: float, text: str) -> None:
        print(f"[{t:6.1f}s] {text}", file=sys.stderr, flush=True)


def _gib(x: Any) -> str:
    return f"{x / (1 << 30):.1f}" if isinstance(x, int | float) else "-"


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, int | float) else "-"


def print_result(run: dict[str, Any], lists: dict[str, list[str]], console: Console) -> None:
    """The five lists, the per-node table and the failed checks with their reasons."""
    for name in ("normal", "abnormal", "standby", "running", "all"):
        console.print(f"{name:>9}: {', '.join(lists.get(name, [])) or '-'}")
    t = Table(title=f"pre-flight {run['run']} ({run['level']}): {run['reason']}")
    for col in ("node", "ok", "load", "mem", "disk", "shm", "left", "skew", "GEMM",
                "AR bw", "AG bw", "lat µs", "train"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("node", "result") else "right")
    for n in run["nodes"]:
        row = run["table"].get(n, {})
        v = run["verdicts"].get(n, {"ok": False})
        t.add_row(
            n, "pass" if v["ok"] else styled(("INCONCLUSIVE", "yellow")) if v.get("inconclusive")
            else styled(("FAIL", "red")), _num(row.get("load_per_core"), ".2f"),
            _gib(row.get("memory_available")), _gib(row.get("disk_free")), _gib(row.get("shm_free")),
            str(row.get("leftovers", "-")), _num(row.get("clock_skew_s"), "+.3f"),
            _num(row.get("gemm_gflops"), ".1f"), _num(row.get("allreduce_busbw_gbps"), ".3f"),
            _num(row.get("allgather_busbw_gbps"), ".3f"), _num(row.get("latency_us"), ".0f"),
            _num(row.get("train_step_s"), ".3f"),
        )  # fmt: skip
    console.print(t)
    console.print(
        "load per core; mem, disk, shm: GiB free; left: leftover processes; GEMM: GFLOP/s; "
        "AR/AG bw: all-reduce/all-gather bus bandwidth GB/s (median over partners); lat: "
        "small all-reduce latency; train: simulated training step time"
    )
    for n in run["nodes"]:
        row = run["table"].get(n, {})
        times = {**row.get("times_s", {}), **row.get("net_times_s", {})}
        if times:
            console.print(
                f"{n} check times: " + ", ".join(f"{k} {v:.2f}s" for k, v in times.items())
            )
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in run.get("stage_s", {}).items())
    console.print(f"stage times: {stages}")
    for n in run["nodes"]:
        v = run["verdicts"].get(n, {})
        for p in v.get("problems", []):
            how = " (inconclusive: the check itself failed, not a measurement)"
            console.print(styled((n, "red"), f": {p}" + (how if v.get("inconclusive") else "")))


async def _local(
    args: argparse.Namespace, ccfg: CheckConfig
) -> tuple[dict[str, Any], dict[str, list[str]]]:
    from trainguard.cli.controller import parse_bind, read_or_create_token
    from trainguard.cli.run import Cluster, _check_writable, controller_info

    run_dir = (
        args.run_dir or Path("runs") / datetime.datetime.now().strftime("check-%Y%m%d-%H%M%S")
    ).resolve()
    _check_writable(run_dir)
    injects = tuple(parse_inject(text, i) for i, text in enumerate(args.inject))
    cfg = JobConfig(
        script="(check)", run_dir=str(run_dir), nodes=args.nodes or 4, injects=injects,
        preflight=PreflightConfig(level=ccfg.level),
        timeouts=TimeoutsConfig(join_timeout_s=args.join_timeout),
    )  # fmt: skip
    host, port = parse_bind(args.bind) if args.bind else ("127.0.0.1", 0)
    token_file = args.token_file or run_dir / "token"
    token = read_or_create_token(token_file)
    store = Store(run_dir)
    controller = Controller(
        cfg, token, store, host=host, port=port, check_only=True, check_cfg=ccfg,
        dashboard=DASHBOARD,
    )  # fmt: skip
    host, port = await controller.start()
    controller_info(run_dir, host, port)
    cluster = None
    if args.bind:
        print(
            f"trainguard: waiting for {cfg.nodes} agents: trainguard agent --controller {host}:{port} "
            f"--token-file {token_file} --run-dir {run_dir} --node-id <name> --advertise-addr <address>",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    else:
        cluster = Cluster(cfg, f"{host}:{port}", token_file)
        cluster.start()
    progress = Progress()
    progress.say(0.0, f"waiting for {cfg.nodes} agent(s) to report (controller {host}:{port})")
    done = asyncio.ensure_future(controller.wait_done())
    try:
        while not done.done():
            pf = controller.preflight
            if pf is not None and pf.runs:
                progress.show(pf.runs[max(pf.runs)].to_json())
            await asyncio.wait([done], timeout=POLL_S)
        state = done.result()
        await asyncio.sleep(min(3.0, cfg.timeouts.heartbeat_s * 4))  # agents fetch the shutdown
    finally:
        if cluster is not None:
            await cluster.wait_exit(30.0)
        await controller.close()
    pf = controller.preflight
    if pf is None or not pf.runs:
        store.close()
        raise ValueError(f"no pre-flight ran: {state.reason}; start the agents (see above)")
    run = pf.runs[max(pf.runs)].to_json()
    progress.show(run)
    store.record("check_ended", {"phase": state.phase.value, "reason": state.reason})
    store.close()
    pools = {n: p.value for n, p in state.pools.items()}
    return run, pool_lists(pools)


class InProgress(Exception):
    def __init__(self, run: int) -> None:
        self.run = run


def _request(
    controller: str, token: str, method: str, path: str, body: dict[str, Any] | None
) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://{controller}{path}", method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=10.0) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as e:
        try:
            body = json.loads(e.read())
        except ValueError:
            body = {"error": str(e)}
        if e.code == 409 and "run" in body:
            raise InProgress(int(body["run"])) from None
        if e.code == 401:
            raise PermissionError(
                f"controller {controller} refused the token; pass --token-file of this job"
            ) from None
        raise ValueError(f"controller {controller}: {body.get('error', e)}") from None
    except (OSError, urllib.error.URLError) as e:
        raise ValueError(
            f"controller {controller} unreachable ({getattr(e, 'reason', e)}); pass the address "
            "from RUN_DIR/controller.json"
        ) from None


def _remote(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, list[str]]]:
    from trainguard.cli.status import _token

    token = _token(args)
    try:
        started = _request(args.controller, token, "POST", "/v1/check", {"level": args.level})
    except InProgress as e:  # a re-check the controller started itself: follow that one
        print(f"pre-flight run {e.run} is in progress; following it", file=sys.stderr)
        started = {"run": e.run}
    if started.get("not_checked") and not args.json:
        print(f"not checked (training): {', '.join(started['not_checked'])}", file=sys.stderr)
    progress = Progress()
    deadline = time.monotonic() + 900.0
    while True:
        run = _request(args.controller, token, "GET", f"/v1/check?run={started['run']}", None)
        progress.show(run)
        if run["stage"] == "done":
            return run, run["lists"]
        if time.monotonic() > deadline:
            raise ValueError(
                f"pre-flight run {started['run']} did not finish in 900 s; see trainguard status"
            )
        time.sleep(POLL_S)


def check_command(args: argparse.Namespace) -> int:
    if args.controller and (args.nodes or args.bind):
        raise ValueError("--controller checks a live job's nodes; leave out --nodes and --bind")
    if args.nodes is not None and args.nodes < 1:
        raise ValueError(f"--nodes {args.nodes}: check at least 1 node")
    ccfg = _check_config(args)
    if not args.json:
        logging.basicConfig(
            level=logging.WARNING, stream=sys.stderr, format="%(asctime)s trainguard %(message)s"
        )
    try:
        run, lists = _remote(args) if args.controller else asyncio.run(_local(args, ccfg))
    except KeyboardInterrupt:
        print("trainguard: check interrupted; its agents were stopped", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps({**run, "lists": lists}, indent=1))
    else:
        print_result(run, lists, make_console())
    return 0 if all(v["ok"] for v in run["verdicts"].values()) and run["verdicts"] else 1
