"""``trainguard controller``: the job's controller on its own, for agents on other hosts.

The same controller that ``trainguard run`` embeds, bound where ``--bind`` says, with the
job token in ``--token-file`` (created, mode 0600, if missing; agents read the same
file). Its address goes to ``RUN_DIR/controller.json`` for ``trainguard status``.

Run again with the same run dir after the controller died (SIGKILL, host reboot): it
resumes the job from its store; agents reconnect; running workers are not restarted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
from pathlib import Path

from trainguard.checkpoint import storage
from trainguard.cli.run import (
    VIEW_TOKEN,
    _lock_run_dir,
    build_config,
    controller_info,
    finish,
    previous_run,
    read_or_create_token,
)
from trainguard.controller.config import JobConfig
from trainguard.controller.jobstate import JobState
from trainguard.controller.server import Controller
from trainguard.controller.store import Store
from trainguard.observe.html import DASHBOARD

log = logging.getLogger("trainguard.controller")


def parse_bind(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--bind {text!r}: give HOST:PORT, e.g. 10.0.0.1:29400 (port 0: any)")
    return host, int(port)


async def _serve(
    cfg: JobConfig,
    token: str,
    token_file: Path,
    host: str,
    port: int,
    resume: JobState | None,
    rerun_of: JobState | None = None,
) -> tuple[JobState, int]:
    store = Store(Path(cfg.run_dir))
    # A job that ended: its agents exited, nothing writes its durable tier any more.
    leftovers = storage.clean_leftovers(Path(cfg.ckpt_dir)) if rerun_of is not None else {}
    controller = Controller(
        cfg, token, store, host=host, port=port, resume=resume, rerun_of=rerun_of,
        leftovers=leftovers, view_token=read_or_create_token(Path(cfg.run_dir) / VIEW_TOKEN),
        dashboard=DASHBOARD,
    )  # fmt: skip
    host, port = await controller.start()
    controller_info(Path(cfg.run_dir), host, port)
    got: list[int] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (got.append(s), controller.request_stop()))
    how = (  # a token handed over by `trainguard run --rdzv-endpoint` (a pipe): its line joins
        "run the same `trainguard run --rdzv-endpoint` line on every host"
        if str(token_file).startswith("/dev/fd/")
        else f"start one agent per host: trainguard agent --controller {host}:{port} "
        f"--token-file {token_file} --run-dir {cfg.run_dir} --node-id <name> "
        "--advertise-addr <the host's address>"
    )
    print(
        f"trainguard: controller on {host}:{port} ({'resumed' if resume else 'new job'}); {how}",
        file=sys.stderr,
        flush=True,
    )
    state = await controller.wait_done()
    # Agents see the terminal state and exit; give them a moment to fetch it.
    await asyncio.sleep(min(5.0, cfg.timeouts.heartbeat_s * 4))
    store.record("job_ended", {"phase": state.phase.value, "reason": state.reason})
    await controller.close()
    store.close()
    return state, (got[0] if got else 0)


def _previous_port(run_dir: Path, host: str) -> int | None:
    try:
        old_host, _, old_port = json.loads((run_dir / "controller.json").read_text())[
            "addr"
        ].rpartition(":")
    except (OSError, ValueError, KeyError):
        return None
    return int(old_port) if old_host == host else None


# What makes a job the same job: a resumed controller refuses to change these.
_IDENTITY = ("script", "script_args", "nodes", "min_nodes", "nproc_per_node")


def _same_job(run_dir: Path, cfg: JobConfig) -> None:
    """Raise ValueError if ``cfg`` differs from the stored job in what defines it."""
    store = Store(run_dir)
    try:
        old = store.get("config") or {}
    finally:
        store.close()
    new = dataclasses.asdict(cfg)
    changed = [k for k in _IDENTITY if k in old and json.dumps(old[k]) != json.dumps(new[k])]
    if changed:
        was = ", ".join(f"{k}={old[k]!r}" for k in changed)
        raise ValueError(
            f"{run_dir} holds an unfinished job with {was}; resume it with the same command, "
            "or pass another --run-dir"
        )


def controller_command(args: argparse.Namespace) -> int:
    host, port = parse_bind(args.bind)
    cfg = build_config(args)
    run_dir = Path(cfg.run_dir)
    lock = _lock_run_dir(run_dir)  # noqa: F841 - held until this process exits
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s trainguard %(message)s"
    )
    token_file = args.token_file or run_dir / "token"
    token = read_or_create_token(token_file)
    resume = rerun_of = None
    if (run_dir / "job.sqlite").exists():
        store = Store(run_dir)
        try:
            state = previous_run(store, run_dir)
        finally:
            store.close()
        if state is not None and not state.phase.terminal:
            resume = state  # its agents may still run: the same incarnation goes on
            _same_job(run_dir, cfg)
            if port == 0:  # agents know the old address: listen there again
                port = _previous_port(run_dir, host) or 0
        else:
            rerun_of = state
    state, sig = asyncio.run(_serve(cfg, token, token_file, host, port, resume, rerun_of))
    return finish(cfg, state, sig)
