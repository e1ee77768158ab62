"""``trainguard status``: a live job's phase, the five node lists and each node's state;
``trainguard stop``: a planned stop of a live job.

Asks the controller (``--controller HOST:PORT``, or the address a controller left in
``RUN_DIR/controller.json``) with the job token; when no controller answers and a run
dir is given, shows the state last persisted in the run's store, saying so.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from trainguard.controller.api import Phase
from trainguard.controller.jobstate import pool_lists
from trainguard.controller.store import open_readonly, read_kv

TIMEOUT_S = 5.0


def fetch(controller: str, token: str) -> dict[str, Any]:
    """GET /v1/status. Raises OSError/URLError when unreachable, PermissionError on a bad token."""
    req = urllib.request.Request(
        f"http://{controller}/v1/status", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise PermissionError(
                f"controller {controller} refused the token; pass --token-file of this job"
            ) from None
        raise


def _token(args: argparse.Namespace) -> str:
    path = args.token_file or (args.run_dir / "token" if args.run_dir else None)
    if path is None:
        raise ValueError("--controller needs the job token: pass --token-file (or --run-dir)")
    try:
        return path.read_text().strip()
    except OSError as e:
        raise ValueError(
            f"token file {path}: {e.strerror}; pass --token-file of this job"
        ) from None


def _controller(args: argparse.Namespace) -> str | None:
    """``--controller``, else the address the run dir's controller left (None: no file)."""
    if args.controller is None and args.run_dir is None:
        raise ValueError("pass --controller HOST:PORT or --run-dir DIR")
    if args.controller is not None:
        return str(args.controller)
    info = args.run_dir / "controller.json"
    if not info.is_file():
        return None
    try:
        return str(json.loads(info.read_text())["addr"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f"{info} is not a controller address file; pass --controller HOST:PORT"
        ) from None


def stop_command(args: argparse.Namespace) -> int:
    """``trainguard stop``: ask the controller for a planned stop (its workers' newest
    snapshots persisted to the durable tier, then every process stopped: what SIGTERM to
    ``trainguard run`` or ``controller`` does) and, with ``--wait S``, wait up to S seconds for
    the job to end. Kubernetes' preStop hook of the controller (deploy/k8s). Exit status 0
    once asked (and ended, with --wait); raises ValueError naming the fix when no controller
    answers or the wait runs out."""
    controller = _controller(args)
    if controller is None:
        raise ValueError(f"{args.run_dir}: no controller.json (no job runs here); "
                         "pass --controller HOST:PORT")  # fmt: skip
    token = _token(args)
    req = urllib.request.Request(f"http://{controller}/v1/stop", data=b"{}", method="POST",
                                 headers={"Authorization": f"Bearer {token}"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            resp.read()
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise ValueError(f"controller {controller} refused the token; pass --token-file "
                             "of this job") from None  # fmt: skip
        raise ValueError(f"controller {controller} answered {e.code} to the stop") from None
    except OSError as e:
        raise ValueError(
            f"controller {controller} unreachable ({e}); is the job running?"
        ) from None
    print(f"trainguard: stop requested from {controller}", flush=True)
    if args.wait <= 0:
        return 0
    deadline = time.monotonic() + args.wait
    phase = "?"
    while time.monotonic() < deadline:
        try:
            phase = str(fetch(controller, token)["phase"])
        except (OSError, urllib.error.URLError, KeyError, ValueError):
            return 0  # the controller exited: the job ended (its store says how)
        if phase in {p.value for p in Phase if p.terminal}:
            print(f"trainguard: the job is {phase}", flush=True)
            return 0
        time.sleep(0.5)
    raise ValueError(f"the job is still {phase} after {args.wait:g}s; see trainguard status")


def status_command(args: argparse.Namespace) -> int:
    controller = _controller(args)
    st: dict[str, Any] | None = None
    source = "live"
    if controller is not None:
        token = _token(args)
        try:
            st = fetch(controller, token)
        except PermissionError:
            raise
        except (OSError, urllib.error.URLError) as e:
            if args.run_dir is None:
                raise ValueError(
                    f"controller {controller} unreachable ({e}); is the job running? "
                    "pass --run-dir to see its last persisted state"
                ) from None
    if st is None:
        db = open_readonly(Path(args.run_dir))
        try:
            st = read_kv(db, "state")
        finally:
            db.close()
        if st is None:
            raise ValueError(f"{args.run_dir}: the job has no persisted state yet")
        st["lists"] = pool_lists(st.get("pools", {}))
        st["nodes"] = {}
        source = "store (no controller answered)"
    st["source"] = source
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    since = time.time() - float(st.get("phase_since", time.time()))
    gen = "-" if st["generation"] < 0 else st["generation"]
    restore = "-" if st.get("restore_step") is None else st["restore_step"]
    print(
        f"phase {st['phase']} for {since:.0f}s · generation {gen} · restarts {st['restarts']} · "
        f"restored from step {restore} · source: {source}"
    )
    ended = st["phase"] in {p.value for p in Phase if p.terminal}
    for name in ("all", "normal", "abnormal", "standby", "running"):
        nodes = ", ".join(st["lists"][name]) or "-"
        if name == "running" and ended:  # nothing runs now: say where the last generation ran
            nodes = f"- (the job ended; its last generation ran on {nodes})"
        print(f"  {name:9s} {nodes}")
    if st["nodes"]:
        print(
            f"\n  {'node':10s} {'addr':16s} {'pool':8s} {'rank':>4s} {'seen':>6s} {'gen':>4s}  workers"
        )
        for node, n in st["nodes"].items():
            workers = " ".join(  # rank, its state and step, its pid (to kill or attach)
                f"r{r}:{w['state']}@{w['step']}" + (f"/pid {w['pid']}" if w.get("pid") else "")
                for r, w in sorted(n["workers"].items(), key=lambda rw: int(rw[0]))
            )
            rank = "-" if n["node_rank"] is None else str(n["node_rank"])
            gen = "-" if n["generation"] is None else str(n["generation"])
            print(
                f"  {node:10s} {n['addr']:16s} {n['pool'] or '-':8s} {rank:>4s} "
                f"{n['last_seen_s']:5.1f}s {gen:>4s}  {workers or '-'}"
            )
            if n.get("health", "ok") != "ok":
                print(f"  {'':10s} host checks: {'; '.join(n['health'])}")
            if n.get("preflight") not in (None, "ok"):
                print(f"  {'':10s} pre-flight: {'; '.join(n['preflight'])}")
    for a in st.get("alerts", []):
        where = f" rank {a['rank']} on {a.get('node')}" if "rank" in a else ""
        what = {k: v for k, v in a.items() if k not in ("kind", "rank", "node", "generation")}
        print(f"  alert {a['kind']}{where}: {json.dumps(what, default=str)[:160]}")
    return 0
