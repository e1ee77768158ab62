"""The same ``trainguard run --rdzv-endpoint`` line on every host, as with torchrun (issue 33).

Three hosts (network namespaces on a bridge) each run one identical command line; the host
that owns the endpoint's address runs the controller, every host an agent; the job token
comes from ``$TRAINGUARD_SECRET`` (no token file is shared). Two hosts train, the third is the
standby. A training host is SIGKILLed whole (its launcher, agent, ckptd and workers): the
standby takes its place, the job ends with the fault-free run's losses, and each surviving
host's console shows exactly its own ranks' lines, prefixed ``[rankN]:``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.conftest import (
    FAST_CONFIG,
    GPT,
    TINY,
    drop_segments,
    events,
    fault_free_losses,
    losses,
    reached_step,
    trainguard_cmd,
    wait_for,
)
from trainguard.faults.netns import Hosts

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
    pytest.mark.timeout(600),
]
STEPS = 40
ARGS = [*TINY, "--steps", str(STEPS), "--ckpt-every", "1", "--durable-every", "5"]
PACE = ["--inject", "slow:rank=0:factor=5"]  # steps of ~0.1 s: the kill lands mid-run
SECRET = "a-secret-shared-by-the-hosts-0123"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    return fault_free_losses(tmp_path_factory, ["--nodes", "2"], ARGS)


def _node_host(hosts: Hosts, node: str) -> int:
    """The host whose address the node id ends in (``<hostname>-<a>-<b>-<c>-<d>``)."""
    (i,) = [i for i, a in enumerate(hosts.addrs) if node.endswith("-" + a.replace(".", "-"))]
    return i


def _kill_line(line: subprocess.Popen[bytes], children: list[int], run: Path) -> None:
    """SIGKILL a line and the children it had, reap it, remove its job's memory segments."""
    for p in [line.pid, *children]:
        with contextlib.suppress(psutil.Error):
            psutil.Process(p).kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        line.wait(timeout=30)
    job = hashlib.sha1(str(run.resolve()).encode()).hexdigest()[:8]
    drop_segments(f"trainguard-{job}-*")


def test_the_same_line_on_three_hosts_trains_survives_a_lost_host_and_tees_each_hosts_ranks(
    hosts: Hosts, tmp_path: Path, reference: dict[int, float]
) -> None:
    run = tmp_path / "run"
    cfg = tmp_path / "job.toml"
    cfg.write_text(FAST_CONFIG)
    line = trainguard_cmd(
        "run", "--nnodes", "2", "--standby", "1", "--nproc-per-node", "1",
        "--rdzv-endpoint", f"{hosts.addrs[0]}:29400", "--run-dir", run, "--config", cfg,
        *PACE, GPT, *ARGS,
    )  # fmt: skip
    env = {**os.environ, "TRAINGUARD_SECRET": SECRET}
    procs: list[subprocess.Popen[bytes]] = []
    outs = [tmp_path / f"console-h{i}.out" for i in range(3)]
    try:
        for i in range(3):
            with open(outs[i], "wb") as out, open(tmp_path / f"console-h{i}.err", "wb") as err:
                procs.append(subprocess.Popen(hosts.cmd(i, line), stdout=out, stderr=err, env=env))
        wait_for(lambda: reached_step(run, 12), 300, "step 12")
        # The generation running at the kill: under load a ckptd slow to start once lost a
        # node in generation 0 (FAST_CONFIG's 3 s node timeout) and the kill fell in gen 1.
        at_kill = [e for e in events(run) if e["kind"] == "generation_started"][-1]
        training = sorted(_node_host(hosts, n) for n in at_kill["assignment"])
        victim = next(i for i in training if i != 0)  # host 0 holds the controller
        assert hosts.kill_all(victim)
        for i in range(3):
            if i != victim:
                assert procs[i].wait(timeout=300) == 0, (
                    tmp_path / f"console-h{i}.err"
                ).read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        hosts.down()
        job = hashlib.sha1(str(run.resolve()).encode()).hexdigest()[:8]
        with contextlib.suppress(OSError):
            drop_segments(f"trainguard-{job}-*")  # what the killed host left in memory
    assert losses(run) == reference
    evs = events(run)
    # the first fault as finally attributed (a survivor's broken collective comes first)
    killed_gen = at_kill["generation"]
    fault = [
        e for e in evs if e["kind"] in ("fault", "fault_refined") and e["generation"] == killed_gen
    ]
    assert fault[-1]["cause"] == "node_lost" and _node_host(hosts, fault[-1]["node_id"]) == victim
    # each host ran what its console shows: its ranks' lines, no other rank's (one process a
    # node: a node's rank is its node rank)
    gens = [e["assignment"] for e in evs if e["kind"] == "generation_started"]
    assert len(gens) >= killed_gen + 2 and _node_host(hosts, next(iter(gens[-1]))) in range(3)
    for i in range(3):
        if i == victim:
            continue
        mine = {r for a in gens for n, r in a.items() if _node_host(hosts, n) == i}
        shown = {int(r) for r in re.findall(r"^\[rank(\d+)\]:", outs[i].read_text(), re.M)}
        assert shown == mine, (i, shown, mine)
    assert not (run / "token").exists()  # the token never went to the shared run dir
    info = json.loads((run / "controller.json").read_text())
    assert info["addr"] == f"{hosts.addrs[0]}:29400"


def test_a_host_with_another_secret_is_told_and_exits_and_a_killed_line_leaves_nothing(
    tmp_path: Path,
) -> None:
    """Two hosts on loopback (``--node-rank``, ``--local-addr``): the second exports another
    secret; its agent is refused, says that the secrets differ, and the line exits 2 within
    ~10 s of its first refusal. Then the first host's line is SIGKILLed: its controller and
    agent get SIGTERM from the kernel (the job's planned stop), nothing of theirs outlives it,
    and no file is left in the temp directory (the token went through pipes)."""
    from tests.helpers.s3server import free_port

    run = tmp_path / "run"
    cfg = tmp_path / "job.toml"
    cfg.write_text(FAST_CONFIG)
    endpoint = f"127.0.0.1:{free_port()}"

    def line(rank: int, addr: str) -> list[str]:
        return trainguard_cmd(
            "run", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
            "--node-rank", str(rank), "--local-addr", addr, "--run-dir", run, "--config", cfg,
            "--inject", "slow:rank=0:factor=20", GPT, *TINY, "--steps", "400",
        )  # fmt: skip

    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    before = {p.name for p in tmp.iterdir() if p.name.startswith("trainguard")}
    first_err = tmp_path / "h0.err"
    with open(first_err, "wb") as err:
        first = subprocess.Popen(
            line(0, "127.0.0.1"), stdout=subprocess.DEVNULL, stderr=err,
            env={**os.environ, "TRAINGUARD_SECRET": SECRET},
        )  # fmt: skip
    children: list[int] = []
    try:
        wait_for(lambda: reached_step(run, 2), 120, "step 2 on the first host")
        children = [c.pid for c in psutil.Process(first.pid).children(recursive=True)]
        other = subprocess.run(
            line(1, "127.0.0.2"), capture_output=True, text=True, timeout=120,
            env={**os.environ, "TRAINGUARD_SECRET": "another-secret-entirely-0123456"},
        )  # fmt: skip
        assert other.returncode == 2, other.stderr[-2000:]
        refused = [x for x in other.stderr.splitlines() if "TRAINGUARD_SECRET" in x]
        assert refused and "differs" in refused[0], other.stderr[-2000:]
        assert first.poll() is None  # the job was not disturbed
        first.kill()  # the whole line, by SIGKILL: its children are told by the kernel
        first.wait(timeout=30)
        try:
            wait_for(lambda: not any(psutil.pid_exists(p) for p in children), 60, "its children")
        except AssertionError as e:
            left = []
            for p in children:
                with contextlib.suppress(psutil.Error):
                    left.append(" ".join(psutil.Process(p).cmdline())[:160])
            raise AssertionError(f"{e}: {left}\n{first_err.read_text()[-3000:]}") from None
    finally:
        _kill_line(first, children, run)
    assert [e for e in events(run) if e["kind"] == "planned_stop"], first_err.read_text()[-2000:]
    after = {p.name for p in tmp.iterdir() if p.name.startswith("trainguard")}
    assert after <= before, after - before


def test_ctrl_c_to_the_lines_process_group_saves_the_newest_step(tmp_path: Path) -> None:
    """A terminal's Ctrl-C: SIGINT to the whole foreground process group of the line. Only the
    line gets it (its controller and agent run in sessions of their own); it hands it to the
    controller, whose planned stop saves the newest snapshot through the agent: no step lost,
    though durable steps are 5 apart (seen before: the agent got it too, left, and the stop
    ended with the newest durable step, 5 steps lost)."""
    from tests.helpers.s3server import free_port

    run = tmp_path / "run"
    cfg = tmp_path / "job.toml"
    cfg.write_text(FAST_CONFIG)
    line = trainguard_cmd(
        "run", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}", "--node-rank", "0", "--local-addr", "127.0.0.1",
        "--run-dir", run, "--config", cfg, "--inject", "slow:rank=0:factor=20", GPT, *TINY,
        "--steps", "400", "--ckpt-every", "1", "--durable-every", "5",
    )  # fmt: skip
    err_path = tmp_path / "line.err"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            line, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
            env={**os.environ, "TRAINGUARD_SECRET": SECRET},
        )  # fmt: skip
    children: list[int] = []
    try:
        wait_for(lambda: reached_step(run, 8), 180, "step 8")
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        proc.wait(timeout=180)
    finally:
        _kill_line(proc, children, run)
    stops = [e for e in events(run) if e["kind"] == "planned_stop"]
    assert stops, err_path.read_text()[-3000:]
    assert stops[-1]["steps_lost"] == 0 and stops[-1]["saved_step"] >= 8, stops
    assert not any(psutil.pid_exists(p) for p in children)
