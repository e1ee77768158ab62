"""A job of real processes a test can fault one by one: ``trainguard controller`` on
127.0.0.1, ``trainguard agent`` ``node<i>`` on 127.0.0.<i+2>, and optionally ``trainguard
relay`` processes (issue 31) on addresses of their own that agents report through. Shared by
``tests/integration/test_store_host_faults.py`` and ``tests/integration/test_relays.py``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import psutil

from tests.conftest import ROOT, drop_segments, trainguard_cmd, wait_for
from trainguard.chaos.faults import job_id, run_processes

RELAY_START_S = 120.0  # a relay imports aiohttp and trainguard: seconds on a loaded machine


class Cluster:
    """``trainguard controller`` on 127.0.0.1 and ``trainguard agent`` ``node<i>`` on
    127.0.0.<i+2>: any of them can be killed, frozen and started again. ``start_relay``
    adds a ``trainguard relay``; ``start_agent(i, relay=ADDR)`` reports through it."""

    def __init__(
        self, run: Path, config: str, ctl_args: list[str], script: Path, script_args: list[str]
    ) -> None:
        self.run = run
        run.mkdir()
        self.cfg = run.parent / "job.toml"
        self.cfg.write_text(config)
        self.ctl_args, self.script, self.script_args = ctl_args, script, script_args
        self.controller: subprocess.Popen[str] | None = None
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        self.relays: dict[str, subprocess.Popen[bytes]] = {}
        self.relay_addrs: dict[str, str] = {}  # relay id → the host:port it serves agents on
        self.old: list[subprocess.Popen[Any]] = []  # killed ones, reaped at the end

    def start_controller(self) -> subprocess.Popen[str]:
        """Start (or restart: the same command, the same run dir) the controller; waits until
        it listens."""
        if self.controller is not None:
            self.old.append(self.controller)
        cmd = trainguard_cmd(
            "controller", "--bind", "127.0.0.1:0", "--run-dir", self.run, "--config", self.cfg,
            *self.ctl_args, self.script, *self.script_args,
        )  # fmt: skip
        self.controller = ctl = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        wait_for(lambda: (info(self.run) or {}).get("pid") == ctl.pid, 60, "the controller")
        return ctl

    def controller_addr(self) -> str:
        return str((info(self.run) or {})["addr"])

    def start_relay(self, relay_id: str, host: str) -> str:
        """Start ``trainguard relay`` ``relay_id`` on ``host`` (a free port) in front of the
        controller; waits until it prints where it listens. Returns that host:port."""
        log_path = self.run / f"relay-{relay_id}.out"
        log = open(log_path, "ab")  # noqa: SIM115
        cmd = trainguard_cmd(
            "relay", "--controller", self.controller_addr(), "--token-file", self.run / "token",
            "--bind", f"{host}:0", "--relay-id", relay_id,
        )  # fmt: skip
        if relay_id in self.relays:
            self.old.append(self.relays[relay_id])
        proc = self.relays[relay_id] = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT)
        log.close()

        def listening() -> str | None:
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            for line in log_path.read_text(errors="replace").splitlines():
                if line.startswith("relay listening on "):
                    return line.removeprefix("relay listening on ").strip()
            return None

        addr = str(wait_for(listening, RELAY_START_S, f"relay {relay_id} to listen"))
        self.relay_addrs[relay_id] = addr
        return addr

    def start_agent(self, i: int, relay: str | None = None) -> subprocess.Popen[bytes]:
        """Start ``node<i>``'s agent (again: a fresh agent of the same node), reporting
        through the relay at ``relay`` (host:port) if given."""
        if i in self.agents:
            self.old.append(self.agents[i])
        addr = self.controller_addr()
        log = open(self.agent_log(i), "ab")  # noqa: SIM115
        cmd = trainguard_cmd(
            "agent", "--controller", addr, "--token-file", self.run / "token",
            "--node-id", f"node{i}", "--addr", f"127.0.0.{i + 2}", "--run-dir", self.run,
            *(["--relay", relay] if relay is not None else []),
        )  # fmt: skip
        self.agents[i] = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT)
        log.close()
        return self.agents[i]

    def agent_log(self, i: int) -> Path:
        return self.run / f"agent-node{i}.out"

    def wait(self, timeout: float = 400) -> None:
        """Until the controller ends with exit 0 and every live agent exited."""
        assert self.controller is not None
        try:
            _, err = self.controller.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not end in {timeout}s") from None
        assert self.controller.returncode == 0, err[-3000:]
        for a in self.agents.values():
            a.wait(timeout=90)

    def close(self) -> None:
        """SIGCONT and SIGKILL whatever is left (a failed test's clean-up), reap everything."""
        procs: list[subprocess.Popen[Any]] = [
            *self.old, *self.agents.values(), *self.relays.values()
        ]  # fmt: skip
        if self.controller is not None:
            procs.append(self.controller)
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.communicate()
        for q in run_processes(self.run):
            with contextlib.suppress(psutil.Error):
                q.resume()
                q.kill()
        drop_segments(f"trainguard-{job_id(self.run)}-*")


def info(run: Path) -> dict[str, Any] | None:
    """The controller's ``RUN_DIR/controller.json`` (pid, addr), None until written."""
    try:
        return dict(json.loads((run / "controller.json").read_text()))
    except (OSError, ValueError):
        return None
