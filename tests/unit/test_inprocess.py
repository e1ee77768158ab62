"""In-process recovery's pure parts: which recovery a fault gets (``controller/inprocess``),
the Stop and control wires, and what the runtime takes for a failed collective."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.unit.test_decide import PEER_LOST, Sim, cfg, desired_for
from trainguard.controller.api import Phase
from trainguard.controller.jobstate import JobState
from trainguard.protocol import ProtocolError, Stop, desired_from_json, desired_to_json
from trainguard.protocol.control import Abort, Resume, control_from_json
from trainguard.protocol.worker import Heartbeat
from trainguard.runtime.inprocess import comm_error


def _opt_in(sim: Sim) -> None:
    for o in sim.obs.values():
        for w in o.workers.values():
            w.inprocess = True


def _crash_opted_in(sim: Sim) -> JobState:
    """Generation 0 running, every rank under trainguard.run; node1's rank killed (-9)."""
    sim.tick()
    sim.run_generation()
    _opt_in(sim)
    w = sim.worker("node1")
    w.state, w.exit_code, w.exited_at = "failed", -9, sim.now
    return sim.tick()


def _next_generation(sim: Sim) -> JobState:
    """The stopping generation's nodes acknowledge the stop until the next one starts."""
    for _ in range(5):
        sim.ack_stop()
        s = sim.tick()
    return s


def test_a_crash_of_an_opted_in_job_keeps_every_other_rank() -> None:
    sim = Sim(cfg(nodes=2), 2)
    s = _crash_opted_in(sim)
    assert s.recovery is not None and s.recovery.mode == "inprocess" and s.recovery.kept == [0]
    stop = desired_for(s, "node0", sim.obs, sim.c)
    assert stop["action"] == "stop" and stop["keep"] == [0] and stop["grace_s"] == 0.0
    assert stop["abort_timeout_s"] == sim.c.timeouts.inprocess_abort_s
    assert ("recovery_mode", {"generation": 0, "mode": "inprocess", "kept": [0],
            "reason": "1 surviving rank(s) keep their processes; rank 1 restarts"}) in sim.events  # fmt: skip


def test_a_plain_script_and_a_switched_off_job_restart_every_rank() -> None:
    sim = Sim(cfg(nodes=2), 2)
    s = sim.crash_node1()  # no rank said it runs under trainguard.run
    assert s.recovery is not None and s.recovery.mode == "restart" and s.recovery.kept == []
    assert "without trainguard.run" in s.recovery.mode_reason
    assert "keep" not in desired_for(s, "node0", sim.obs, sim.c)  # the wire as before

    s = _crash_opted_in(Sim(cfg(nodes=2, restart={"inprocess": False}), 2))
    assert s.recovery is not None and s.recovery.mode == "restart"
    assert "restart.inprocess = false" in s.recovery.mode_reason


def test_a_parked_victim_alone_is_kept_and_a_lost_node_drops_its_ranks() -> None:
    """Node 1 went silent; node 0's rank parked on its failed collective. The fault (first seen
    as the victim's) keeps it; once node 1 is lost its rank is not counted as kept."""
    sim = Sim(cfg(nodes=2), 2)
    sim.tick()
    sim.run_generation()
    _opt_in(sim)
    v = sim.worker("node0")
    v.state, v.parked_at = "parked", sim.now
    s = sim.tick(1.2, seen=("node0",))  # past 2 x heartbeat with only a victim
    assert s.phase == Phase.STOPPING and s.recovery is not None
    assert s.recovery.mode == "inprocess" and 0 in s.recovery.kept
    assert s.recovery.mode_reason.endswith("no failed rank seen yet"), s.recovery.mode_reason
    sim.obs["node0"].stopped_generation = 0
    sim.obs["node0"].stopped_at = sim.obs["node0"].ckptd_at = sim.now
    for _ in range(60):  # node1 is declared lost after node_timeout_s; STOPPING waits for it
        s = sim.tick(0.1, seen=("node0",))
    assert s.recovery is not None and s.recovery.kept == [0], s.recovery
    assert s.recovery.fault.cause.value == "node_lost"
    assert s.recovery.mode_reason == (
        "1 surviving rank(s) keep their processes; the ranks of lost node(s) node1 restart"
    )


def test_without_a_checkpoint_to_restore_every_rank_restarts() -> None:
    """A fault before any checkpoint: a kept process would carry the state it trained (a model
    made outside the training function) into a generation that starts from step 0. The
    recovery becomes a restart, and the Run has no restore point (agents resume nothing)."""
    sim = Sim(cfg(nodes=2), 2)
    s = _crash_opted_in(sim)  # no checkpoint: sim.ckpt is empty
    assert s.recovery is not None and s.recovery.mode == "inprocess"
    s = _next_generation(sim)
    assert s.generation == 1 and s.recovery is not None, s.phase
    assert s.recovery.mode == "restart" and s.recovery.kept == []
    assert s.recovery.mode_reason.startswith("no checkpoint every rank agrees on yet")
    run = desired_for(s, "node0", sim.obs, sim.c)
    assert run["action"] == "run" and run["restore_step"] is None

    sim = Sim(cfg(nodes=2), 2)  # the same fault with step 4 saved: in process
    sim.ckpt = [(4, 0)]
    s = _crash_opted_in(sim)
    s = _next_generation(sim)
    assert s.generation == 1 and s.recovery is not None
    assert s.recovery.mode == "inprocess" and s.recovery.kept == [0] and s.restore_step == 4


def test_stop_and_control_wires_round_trip_and_refuse_nonsense() -> None:
    stop = Stop(generation=3, grace_s=0.0, keep=[0, 2], abort_timeout_s=5.0)
    assert desired_from_json(desired_to_json(stop)) == stop
    for bad in ({"keep": [0, "1"]}, {"keep": 3}, {"keep": [0], "abort_timeout_s": -1}):
        with pytest.raises(ProtocolError):
            desired_from_json({**desired_to_json(stop), **bad})
    a, r = Abort(generation=2, reason="x"), Resume(generation=3, env={"RANK": "1"}, unset=("A",))
    assert control_from_json(a.to_json()) == a and control_from_json(r.to_json()) == r
    for body in ({"t": "abort"}, {"t": "resume", "gen": 1, "env": {"A": 1}}, {"t": "x", "gen": 1},
                 {"t": "abort", "gen": 1, "v": 99}):  # fmt: skip
        with pytest.raises(ProtocolError):
            control_from_json(body)
    hb = Heartbeat(ts=1.0, inprocess=True, parked=True)
    assert Heartbeat.from_json(hb.to_json()) == hb
    assert Heartbeat.from_json(Heartbeat(ts=1.0).to_json()).inprocess is False
    with pytest.raises(ProtocolError):
        Heartbeat.from_json({"ts": 1.0, "inproc": True})


def test_what_counts_as_a_failed_collective() -> None:
    assert comm_error(RuntimeError(PEER_LOST))
    assert comm_error(RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                                   "Timed out waiting 1000ms for recv operation to complete"))  # fmt: skip
    try:
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError as e:
            raise ValueError("wrapped") from e
    except ValueError as wrapped:
        assert comm_error(wrapped)  # its cause was the collective's
    assert not comm_error(ValueError("bad batch shape"))
    assert not comm_error(RuntimeError("CUDA out of memory"))
    assert not comm_error(KeyError("loss"))
    # a user's own network error (a tracker, a data service) is the script's failure
    assert not comm_error(ConnectionRefusedError(111, "Connection refused"))


def test_an_sdc_or_a_rendezvous_timeout_restarts_every_rank() -> None:
    from trainguard.controller.api import Fault
    from trainguard.controller.inprocess import plan
    from trainguard.protocol import FaultCause

    sim = Sim(cfg(nodes=2), 2)
    sim.tick()
    sim.run_generation()
    _opt_in(sim)
    for cause in (FaultCause.SDC, FaultCause.RENDEZVOUS_TIMEOUT):
        f = Fault(cause=cause, generation=0, rank=1, node_id="node1", step=5, t_fault=sim.now,
                  t_detected=sim.now)  # fmt: skip
        keep, why = plan(sim.s, f, sim.obs, sim.now, sim.c)
        assert keep == [] and f"a {cause.value} fault restarts every rank" == why
    f = Fault(cause=FaultCause.HANG, generation=0, rank=1, node_id="node1", step=5,
              t_fault=sim.now, t_detected=sim.now)  # fmt: skip
    assert plan(sim.s, f, sim.obs, sim.now, sim.c)[0] == [0]


def test_orphan_multiprocessing_semaphores_are_dropped_and_live_ones_kept(tmp_path) -> None:
    import mmap
    import multiprocessing
    from pathlib import Path

    from trainguard.agent.workers import drop_orphan_semaphores

    shm = Path("/dev/shm")
    orphan, live = shm / f"sem.mp-tg-orphan-{os.getpid()}", shm / f"sem.mp-tg-live-{os.getpid()}"
    young = shm / f"sem.mp-tg-young-{os.getpid()}"
    for f in (orphan, live, young):
        f.write_bytes(b"\0" * 32)
    for f in (orphan, live):  # made a minute ago
        os.utime(f, (time.time() - 60, time.time() - 60))
    # A real one, made by this process the way a spawn DataLoader's queues are: glibc maps it
    # under a temporary name, so only its inode says it is in use (CI: a name match removed
    # another job's, and its DataLoader workers died).
    before = set(shm.glob("sem.mp-*"))
    real_lock = multiprocessing.get_context("spawn").Lock()
    (real,) = set(shm.glob("sem.mp-*")) - before
    os.utime(real, (time.time() - 60, time.time() - 60))
    with open(live, "r+b") as fh, mmap.mmap(fh.fileno(), 32):  # mapped: in use
        gone = drop_orphan_semaphores(shm)
        assert orphan.name in gone and live.name not in gone and live.exists()
    assert real.exists() and real.name not in gone, gone
    assert young.exists() and young.name not in gone  # a moment old: left alone
    assert not orphan.exists()
    live.unlink()
    young.unlink()
    del real_lock


def test_a_fault_during_a_recovery_keeps_the_first_fault_on_record() -> None:
    """Rank 0 dies while generation 1 (the recovery from rank 1's crash) has not made its first
    step: both faults are on record (the report lists every fault), the first as an attempt
    that never reached its first step."""
    sim = Sim(cfg(nodes=2), 2)
    sim.ckpt = [(4, 0)]
    s = _crash_opted_in(sim)
    s = _next_generation(sim)
    assert s.generation == 1 and s.recovery is not None
    sim.run_generation()
    _opt_in(sim)
    w = sim.worker("node0")
    w.state, w.exit_code, w.exited_at = "failed", -9, sim.now
    s = sim.tick()
    assert s.recovery is not None and s.recovery.fault.generation == 1
    assert [(r.fault.generation, r.fault.rank, r.t_first_step) for r in s.recoveries] == [
        (0, 1, None)
    ]


_HALF_MADE = """
import datetime, sys, torch, torch.distributed as dist
from trainguard.runtime.inprocess import _destroy_process_group
rank, port, release = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "release"
if rank == 0:  # the first try: the peer never comes, init_process_group raises
    t = datetime.timedelta(seconds=1)
    lone = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=t, wait_for_workers=False)
    try:
        dist.init_process_group("gloo", store=lone, rank=0, world_size=2, timeout=t)
    except Exception as e:
        print("first try:", type(e).__name__, file=sys.stderr)
    if release:
        _destroy_process_group()
t = datetime.timedelta(seconds=6)
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=t)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=t)
x = torch.ones(1)
dist.all_reduce(x)
print(x.item(), flush=True)
dist.destroy_process_group()  # gloo's threads joined before exit (else, at times, SIGABRT)
"""


def _two_ranks_after_a_half_made_group(release: bool) -> list[subprocess.CompletedProcess[str]]:
    """Rank 0 (a survivor) had an ``init_process_group`` fail, then forms a group with a fresh
    rank 1 (a new process) at a store this test hosts."""
    import datetime
    import sys

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)  # fmt: skip
    how = "release" if release else "keep"
    procs = [subprocess.Popen([sys.executable, "-c", _HALF_MADE, str(r), str(store.port), how],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]  # fmt: skip
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=60)
        finally:
            p.kill()
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    del store
    return out


def test_a_group_half_made_when_the_fault_came_is_forgotten_on_release() -> None:
    """A survivor whose ``init_process_group`` a fault interrupted re-forms the world with the
    new rank: the release resets torch's group number (the key prefix). Without it the two
    ranks wait for each other under different prefixes until the store's timeout (the chaos
    run of 2026-12-04 hung 300 s at each recovery after a SIGSTOP during start-up)."""
    released = _two_ranks_after_a_half_made_group(release=True)
    assert [(r.returncode, r.stdout.strip()) for r in released] == [(0, "2.0")] * 2, released
    kept = _two_ranks_after_a_half_made_group(release=False)  # the fault the release fixes
    assert [r.returncode for r in kept] == [1, 1], kept
    assert "keys: /1//cpu//0/1" in kept[0].stderr, kept[0].stderr[-2000:]  # rank 0's prefix
    assert "keys: /0//cpu//0/0" in kept[1].stderr, kept[1].stderr[-2000:]  # the new rank's
