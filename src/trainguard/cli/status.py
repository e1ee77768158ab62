"""``trainguard status``: a live job's phase, the five node lists and each node's state.

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


def status_command(args: argparse.Namespace) -> int:
    if args.controller is None and args.run_dir is None:
        raise ValueError("pass --controller HOST:PORT or --run-dir DIR")
    controller = args.controller
    if controller is None:
        info = args.run_dir / "controller.json"
        if info.is_file():
            try:
                controller = str(json.loads(info.read_text())["addr"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"{info} is not a controller address file; pass --controller HOST:PORT"
                ) from None
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
