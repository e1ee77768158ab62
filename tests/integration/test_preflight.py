"""Pre-flight checks against real faults: a CPU-throttled node (cgroup quota), a rate-limited
link (tc tbf in the node's namespace), a GEMM that returns a wrong result, a leftover
process of an earlier job, a nearly full /dev/shm and checkpoint disk. Each must flag the
right node with the right reason, and only it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import (
    PREFLIGHT_CONFIG,
    ROOT,
    TINY,
    reached_step,
    report,
    start_job,
    trainguard_cmd,
    wait_for,
)
from tests.conftest import events as read_events
from trainguard.faults.netns import Hosts

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and cgroups need root")
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


def problems(result: dict[str, Any]) -> dict[str, list[str]]:
    return {n: v["problems"] for n, v in result["verdicts"].items()}


def check_local(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str, float]:
    """``trainguard check --nodes 4 --json`` on simulated nodes: (result, stderr, seconds)."""
    t0 = time.monotonic()
    out = subprocess.run(
        trainguard_cmd("check", "--nodes", "4", "--run-dir", tmp_path / "run", "--json", *args),
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert out.returncode in (0, 1), out.stderr[-3000:]
    return json.loads(out.stdout), out.stderr, took


def check_hosts(
    tmp_path: Path,
    hosts: Hosts,
    setup: dict[int, str] | None = None,
    before: dict[int, Callable[[int], None]] | None = None,
) -> tuple[dict[str, Any], str]:
    """``trainguard check --bind`` on the bridge, one real agent per namespace. ``setup[i]``
    is a shell line run in host i's namespace (its own mount namespace) before its agent;
    ``before[i](pid)`` runs here, on that process, before the agent starts."""
    run_dir = tmp_path / "run"
    ctl = subprocess.Popen(
        trainguard_cmd(
            "check", "--nodes", len(hosts.names), "--bind", f"{hosts.gateway}:0",
            "--run-dir", run_dir, "--json", "--join-timeout", "60",
        ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    agents = []
    try:
        info = run_dir / "controller.json"

        def listening() -> bool:
            try:
                return bool(json.loads(info.read_text())["pid"] == ctl.pid)
            except (OSError, ValueError, KeyError):
                return False

        wait_for(listening, 60, "the check controller to listen")
        addr = json.loads(info.read_text())["addr"]
        for i, host_addr in enumerate(hosts.addrs):
            agent = trainguard_cmd(
                "agent", "--controller", addr, "--token-file", run_dir / "token",
                "--node-id", f"h{i}", "--advertise-addr", host_addr, "--run-dir", run_dir,
            )  # fmt: skip
            line = (setup or {}).get(i, "true")
            gate = tmp_path / f"go-h{i}"
            wait = f"while [ ! -e {gate} ]; do sleep 0.05; done"
            argv = ["sh", "-c", f'{line} && {wait} && exec "$@"', "sh", *agent]
            log = open(tmp_path / f"agent-h{i}.out", "ab")  # noqa: SIM115
            env = {**os.environ, "TRAINGUARD_CHECK_THREADS": "1"}  # hosts share 2 cores here
            # `ip netns exec` execs its command: the pid is the shell's, then the agent's.
            agents.append(
                subprocess.Popen(hosts.cmd(i, argv), stdout=log, stderr=log, cwd=ROOT, env=env)
            )
            log.close()
            if i in (before or {}):
                (before or {})[i](agents[-1].pid)
            gate.touch()
        out, err = ctl.communicate(timeout=240)
        for a in agents:
            a.wait(timeout=60)
        assert ctl.returncode in (0, 1), err[-3000:]
        return json.loads(out), err
    finally:
        for p in [ctl, *agents]:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    h = Hosts(4).up()
    try:
        yield h
    finally:
        h.down()


def test_a_node_whose_gemm_is_wrong_is_caught_and_each_stage_is_timed(
    tmp_path: Path,
) -> None:
    result, err, took = check_local(tmp_path, "--inject", "gemm-wrong:node=2")
    got = problems(result)
    logs = {  # a check cut off at its deadline leaves its stack there (agent/checks.py)
        f.name: f.read_text(errors="replace")[-3000:]
        for f in sorted((tmp_path / "run" / "checks").glob("*.log"))
        if f.stem.split(".")[0] in got and got[f.stem.split(".")[0]]
    }
    assert [n for n, p in got.items() if p] == ["node2"], (got, logs)
    assert len(got["node2"]) == 1 and "GEMM wrong" in got["node2"][0], got
    assert result["lists"]["abnormal"] == ["node2"]
    assert result["lists"]["normal"] == ["node0", "node1", "node3"]
    # Issue 5: each check's time printed. Its 60 s target for 4 simulated nodes is measured
    # by benchmarks/preflight.py on an idle machine: beside CI's second test worker the same
    # run takes twice as long (67 s there, 31 s alone). Here: no stage near its deadline.
    assert result["stage_s"]["total"] < 150 and took < 200, (result["stage_s"], took)
    for check in ("host", "gemm_correctness", "gemm", "pairs", "train"):
        assert f"{check} " in err, err[-2000:]
    for n in ("node0", "node1", "node3"):  # the passing nodes went through every stage
        row = result["table"][n]
        assert row["gemm_gflops"] > 0 and row["allreduce_busbw_gbps"] > 0, row
        assert row["train_step_s"] > 0 and row["latency_us"] > 0, row
    assert "allreduce_busbw_gbps" not in result["table"]["node2"]  # screened out before stage 2
    # Results persist in the store.
    db = subprocess.run(
        trainguard_cmd("events", "--run-dir", tmp_path / "run", "--kind", "preflight_finished", "--json"),
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "GEMM wrong" in db


@pytest.mark.alone  # a detector's timing: nothing else runs beside it in CI
@ROOT_ONLY
@pytest.mark.slow  # minutes on 2 cores: in CI's slow run
def test_a_cpu_throttled_node_is_flagged_for_slow_gemm(tmp_path: Path, hosts: Hosts) -> None:
    cg = CPU_CGROUP / f"tgtest{os.getpid()}"
    cg.mkdir()
    try:
        (cg / "cpu.cfs_period_us").write_text("100000")
        # 20% of one CPU: GEMM at a fifth of its rate, far under gemm_min_ratio (0.5) of the
        # pool's. The node's agent shares the quota with its check: at 10% the check wrote its
        # result 8 s before the node stage's 120 s deadline and the agent's report missed it
        # (an inconclusive verdict, not the slow GEMM this test is about).
        (cg / "cpu.cfs_quota_us").write_text("20000")
        procs = cg / "cgroup.procs"  # (/sys/fs/cgroup is not mounted inside `ip netns exec`)
        result, _ = check_hosts(tmp_path, hosts, before={1: lambda pid: procs.write_text(str(pid))})
    finally:
        wait_for(lambda: not (cg / "cgroup.procs").read_text().strip(), 30, "the cgroup to empty")
        cg.rmdir()
    got = problems(result)
    assert [n for n, p in got.items() if p] == ["h1"], got
    assert any("GEMM slow" in p for p in got["h1"]), got


@pytest.mark.alone  # a detector's timing: nothing else runs beside it in CI
@ROOT_ONLY
@pytest.mark.slow  # minutes on 2 cores: in CI's slow run
def test_a_rate_limited_link_is_flagged_for_slow_collectives(tmp_path: Path, hosts: Hosts) -> None:
    subprocess.run(
        hosts.cmd(2, ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "100mbit",
                      "burst", "64kb", "latency", "100ms"]),
        check=True, timeout=30,
    )  # fmt: skip
    result, _ = check_hosts(tmp_path, hosts)
    got = problems(result)
    assert [n for n, p in got.items() if p] == ["h2"], got
    assert len(got["h2"]) == 1 and "collectives slow with 3 partners" in got["h2"][0], got
    fast = [result["table"][n]["allreduce_busbw_gbps"] for n in ("h0", "h1", "h3")]
    assert result["table"]["h2"]["allreduce_busbw_gbps"] < 0.5 * min(fast), result["table"]


@ROOT_ONLY
def test_leftover_process_full_shm_and_full_disk_each_flag_their_node(
    tmp_path: Path, hosts: Hosts
) -> None:
    # h0: a worker of an earlier job still runs there (its environment names the node).
    leftover = subprocess.Popen(
        hosts.cmd(0, ["sleep", "600"]),
        env={**os.environ, "TRAINGUARD_NODE_ID": "h0", "TG_TEST": str(tmp_path)},
    )
    ckpt = tmp_path / "run" / "checkpoints"
    try:
        result, _ = check_hosts(
            tmp_path,
            hosts,
            {
                # h1: its own /dev/shm of 200 MiB, 150 MiB of it taken.
                1: "mount -t tmpfs -o size=200m tmpfs /dev/shm && "
                "fallocate -l 150m /dev/shm/filler",
                # h3: the checkpoint disk 600 MiB, 500 MiB of it taken.
                3: f"mkdir -p {ckpt} && mount -t tmpfs -o size=600m tmpfs {ckpt} && "
                f"fallocate -l 500m {ckpt}/filler",
            },
        )
    finally:
        leftover.kill()
        leftover.wait(timeout=10)
    got = problems(result)
    assert not got["h2"], got
    assert len(got["h0"]) == 1 and "leftover processes of an earlier job: 1" in got["h0"][0], got
    assert str(leftover.pid) in got["h0"][0] or "sleep 600" in got["h0"][0], got
    assert len(got["h1"]) == 1 and got["h1"][0].startswith("shm: 0.05 GiB free at /dev/shm"), got
    assert len(got["h3"]) == 1 and got["h3"][0].startswith("disk: 0.10 GiB free"), got
    assert result["lists"]["abnormal"] == ["h0", "h1", "h3"]
    with contextlib.suppress(FileNotFoundError):
        assert not (ckpt / "filler").exists()  # the mount was private to h3


@pytest.mark.slow  # in CI's slow run (keeps the default suite under 15 min)
def test_a_job_leaves_out_a_node_that_fails_preflight_and_keeps_it_quarantined(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    steps = 150
    job = start_job(
        run_dir,
        ["--nodes", "2", "--standby", "1", "--inject", "gemm-wrong:node=1",
         "--inject", "slow:rank=0:factor=10"],
        [*TINY, "--steps", str(steps), "--ckpt-every", "10", "--durable-every", "50"],
        config=PREFLIGHT_CONFIG,
    )  # fmt: skip
    try:
        wait_for(lambda: reached_step(run_dir, 5), 180, "training to start")
        # The job runs on node0 and node2 (the standby took node1's place).
        started = [e for e in read_events(run_dir) if e["kind"] == "generation_started"]
        assert started[0]["assignment"] == {"node0": 0, "node2": 1}, started
        # A check of the live job's idle nodes: only node1 is idle (quarantined).
        addr = json.loads((run_dir / "controller.json").read_text())["addr"]
        check = subprocess.run(
            trainguard_cmd("check", "--controller", addr, "--run-dir", run_dir, "--json"),
            capture_output=True, text=True, timeout=180, cwd=ROOT,
        )  # fmt: skip
        out, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate(timeout=30)
    assert job.returncode == 0, err[-3000:]
    evs = read_events(run_dir)
    left = [e for e in evs if e["kind"] == "pool_changed" and e["node"] == "node1"]
    assert left[0]["to"] == "faulty" and "failed pre-flight: GEMM wrong" in left[0]["reason"], left
    rechecks = [e for e in evs if e["kind"] == "recheck_failed" and e["node"] == "node1"]
    assert rechecks and "GEMM wrong" in rechecks[0]["problems"][0], rechecks  # not readmitted
    assert not [e for e in left if e["to"] == "standby"]
    rep = report(run_dir)
    assert "GEMM wrong" in rep["left_out"]["node1"], rep["left_out"]
    assert rep["preflight"][0]["failed"] == {"node1": rep["preflight"][0]["failed"]["node1"]}
    assert len(rep["steps_completed"]) == steps
    # quarantined, or retired once re-checked retire_after times (how many fit in the job's
    # run time depends on the machine's load); either way the reason is the wrong GEMM
    left_out = out.replace("\n", " ")
    assert (
        "left out: node1: " in left_out and "GEMM wrong" in left_out.split("left out: node1: ")[1]
    )
    assert check.returncode == 1, check.stderr[-2000:]
    got = json.loads(check.stdout)
    assert got["nodes"] == ["node1"] and not got["verdicts"]["node1"]["ok"], got
    assert "GEMM wrong" in got["verdicts"]["node1"]["problems"][0], got
    assert got["lists"]["running"] == ["node0", "node2"], got["lists"]


# Clean runs in a row that must flag no node: 10 by default; CI's alone run (.ci/run) sets 5 to
# hold its 90 minutes (each run is a whole `trainguard check`, ~30 s here).
CLEAN_RUNS = int(os.environ.get("TRAINGUARD_CLEAN_PREFLIGHT_RUNS", "10"))


@pytest.mark.alone  # a detector's timing: nothing else runs beside it in CI
@pytest.mark.slow
@pytest.mark.timeout(900)  # ten whole `trainguard check` runs, ~30 s each here
def test_repeated_runs_on_a_clean_pool_flag_no_node(tmp_path: Path) -> None:
    totals = []
    for i in range(CLEAN_RUNS):
        result, _, _ = check_local(tmp_path / f"r{i}")
        assert all(v["ok"] for v in result["verdicts"].values()), (i, problems(result))
        totals.append(result["stage_s"]["total"])
    print(f"quick pre-flight, 4 simulated nodes, {CLEAN_RUNS} clean runs: {sorted(totals)} s")
    assert len(totals) == CLEAN_RUNS >= 1 and max(totals) < 60, totals


@pytest.mark.slow
def test_a_check_stalled_by_load_is_inconclusive_retried_and_the_job_runs(tmp_path: Path) -> None:
    """Issue 12 case 6: node1's check process is SIGSTOPped (as a loaded 2-core machine
    starves it) past the node stage's deadline. Its verdict is inconclusive, not a failure:
    the node is checked again after the back-off, passes, and the job trains on both nodes."""
    run_dir = tmp_path / "run"
    config = (
        PREFLIGHT_CONFIG + "[checks]\nnode_stage_timeout_s = 25.0\ninconclusive_backoff_s = 1.0\n"
    )
    job = start_job(run_dir, ["--nodes", "2"], [*TINY, "--steps", "10"], config=config)
    stopped: list[psutil.Process] = []

    def check_of_node1() -> list[psutil.Process]:
        """This job's node1 check (its task file is under this test's run dir): a match on
        the names alone SIGSTOPped another test's node1 check beside it (`-n 2`), whose
        stage then ran out and whose job ended before its re-check."""
        task = str(run_dir / "checks" / "node1.1-node.task.json")
        return [
            p for p in psutil.process_iter()
            if "trainguard.health.node" in _cmdline(p) and task in _cmdline(p)
        ]  # fmt: skip

    try:
        for p in wait_for(check_of_node1, 120, "node1's first check process"):
            p.suspend()  # SIGSTOP: a real stopped process, not a mock
            stopped.append(p)
        wait_for(
            lambda: any(e["kind"] == "preflight_inconclusive" for e in read_events(run_dir)),
            120,
            "the inconclusive verdict",
        )
        out, err = job.communicate(timeout=300)
    finally:
        for p in stopped:
            with contextlib.suppress(psutil.Error):
                p.resume()
        if job.poll() is None:
            job.kill()
            job.communicate(timeout=30)
    assert job.returncode == 0, err[-3000:]
    evs = read_events(run_dir)
    unsure = [(e["node"], e["attempt"]) for e in evs if e["kind"] == "preflight_inconclusive"]
    # node1's first attempt, stopped past the deadline; on CI's loaded machine node0's first
    # check once ran past the 25 s too (inconclusive as well, and retried: the same rule).
    assert ("node1", 1) in unsure and set(unsure) <= {("node0", 1), ("node1", 1)}, unsure
    assert not [e for e in evs if e["kind"] == "pool_changed" and e["to"] == "faulty"]
    started = [e for e in evs if e["kind"] == "generation_started"]
    assert started[0]["assignment"] == {"node0": 0, "node1": 1}, started
    rep = report(run_dir)
    assert "node1" in rep["preflight"][0]["inconclusive"] and not rep["preflight"][0]["failed"]
    # the stopped check's stack went to its log before it was killed: where it was stuck
    log = (run_dir / "checks" / "node1.1-node.log").read_text()
    assert "trainguard: check stopped after" in log and "Thread" in log, log[-2000:]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []
