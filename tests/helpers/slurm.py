"""A real one-host Slurm for tests: ``munged``, ``slurmctld`` and ``slurmd`` (Debian's
``slurm-wlm`` and ``munge`` packages) started from a generated ``slurm.conf`` under a temporary
directory, on free loopback ports, with their own munge socket and key; every daemon is
stopped at the end. Nothing is installed here: ``.ci/run`` installs the packages, and
``available()`` says why a test must skip where they are missing or this is not root."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.helpers.s3server import free_port

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel")


def available() -> str | None:
    """None when a Slurm can be started here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as their user)"
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"Slurm/munge not installed ({', '.join(missing)}): apt-get install slurm-wlm munge"
    return None


@dataclass
class Slurm:
    dir: Path
    env: dict[str, str]
    node: str
    cpus: int

    def run(self, *cmd: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout, env=self.env, check=False
        )

    def sbatch(self, script: Path, *args: str, env: dict[str, str] | None = None) -> int:
        res = subprocess.run(
            ["sbatch", "--parsable", *args, str(script)],
            capture_output=True, text=True, timeout=60, env={**self.env, **(env or {})},
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        return int(res.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, …); {} once purged."""
        res = self.run("scontrol", "show", "job", "-o", str(job_id))
        if res.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", res.stdout))

    def wait_state(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(1.0)
        raise AssertionError(f"job {job_id} not in {states} after {timeout}s: {info}")


def _conf(d: Path, node: str, cpus: int, ctl_port: int, node_port: int) -> str:
    return f"""ClusterName=tgtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctl_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock,cred_expire=10
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=tg Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""


@contextlib.contextmanager
def slurm_cluster(d: Path, cpus: int = 16) -> Iterator[Slurm]:
    """Start munged, slurmctld and slurmd for one node (this host, ``cpus`` CPUs declared so
    that several agents fit), yield it, then cancel every job and stop every daemon."""
    for sub in ("state", "spool"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    node = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(_conf(d, node, cpus, free_port(), free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    key = d / "munge.key"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, timeout=30)
    os.chmod(key, 0o400)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={d}/munge.sock",
             f"--key-file={key}", f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
             f"--seed-file={d}/munged.seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
        deadline = time.monotonic() + 30
        while not (d / "munge.sock").exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, "munged did not start"
            time.sleep(0.1)
        procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        procs.append(subprocess.Popen(["slurmd", "-D", "-f", str(conf), "-N", node], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        s = Slurm(d, env, node, cpus)
        deadline = time.monotonic() + 90
        while True:
            out = s.run("sinfo", "-h", "-o", "%T").stdout.strip()
            if out in ("idle", "mixed", "allocated"):
                break
            dead = [p.args[0] for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "".join(f"\n--- {f.name}\n" + f.read_text()[-1500:] for f in d.glob("*.log"))
                raise AssertionError(f"Slurm did not come up (sinfo: {out!r}, dead: {dead}){logs}")
            time.sleep(0.5)
        yield s
    finally:
        if procs:
            with contextlib.suppress(Exception):
                subprocess.run(["scancel", "--full", "--user", "root"], env=env, timeout=30,
                               capture_output=True)  # fmt: skip
                time.sleep(2)
        for p in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p in psutil.process_iter(["name"]):  # a job step's daemon outlives slurmd
            if p.info["name"] == "slurmstepd":
                with contextlib.suppress(psutil.Error):
                    for c in [*p.children(recursive=True), p]:
                        c.kill()
