"""The quorum ledger (runtime/quorum.py) on a real TCPStore: racing writers make one history;
and the report's reduced-width account (observe/local.py) from epochs."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from trainguard.observe.local import local_recoveries, reduced_width
from trainguard.runtime import quorum


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=10))  # fmt: skip


def test_racing_writers_make_one_history(store: TCPStore) -> None:
    quorum.ensure(store, 8)
    clients = [quorum.connect("127.0.0.1", store.port) for _ in range(8)]
    go = threading.Event()

    def leave(g: int) -> None:
        go.wait()
        quorum.leave(clients[g], g, f"group {g} died")

    threads = [threading.Thread(target=leave, args=(g,)) for g in range(1, 8)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(timeout=30)
    history = [quorum.read(store, e) for e in range(8)]
    assert all(h is not None for h in history) and quorum.read(store, 8) is None
    assert [len(h.members) for h in history if h] == list(range(8, 0, -1))  # one out each
    assert quorum.latest(store).members == (0,)
    again = quorum.leave(clients[0], 3, "repeat")  # not a member: no new epoch
    assert again.epoch == 7
    back = quorum.join(clients[0], 5, "group 5 is back")
    assert back.epoch == 8 and back.members == (0, 5)


def test_waiting_for_the_next_epoch_has_a_deadline(store: TCPStore) -> None:
    quorum.ensure(store, 2)
    t0 = time.monotonic()
    with pytest.raises(quorum.QuorumError, match="no quorum epoch after 0"):
        quorum.wait_after(store, 0, time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 2.0
    threading.Timer(0.2, lambda: quorum.leave(store, 1, "x")).start()
    assert quorum.wait_after(store, 0, time.monotonic() + 5).members == (0,)


def test_members_that_report_alive_evict_the_others_and_an_agents_record_wins(
    store: TCPStore,
) -> None:
    """A failed collective with no death (a partition): the reporters write E+1 of those that
    reported; two evictors racing, and an agent's ``leave`` before them, make one record."""
    quorum.ensure(store, 3)
    quorum.report_alive(store, 0, 0)
    quorum.report_alive(store, 0, 2)
    assert quorum.alive(store, 0, (0, 1, 2)) == [0, 2]
    first = quorum.evict(store, 0, quorum.alive(store, 0, (0, 1, 2)), "group(s) [1] unreachable")
    late = quorum.evict(store, 0, [0], "a stale view")  # loses: the record stands
    assert first == late and first.members == (0, 2) and quorum.latest(store) == first
    quorum.leave(store, 2, "rank 2 killed by signal 9")  # an agent, before the evictors
    assert quorum.evict(store, 1, [0, 2], "late").members == (0,)
    assert quorum.latest(store).epoch == 2


def test_a_call_to_a_frozen_store_raises_at_its_deadline(tmp_path: Path) -> None:
    """A store server that stops answering without closing (SIGSTOP: the connection stays,
    as across a partition) must not block a caller past the client's timeout."""
    port_file = tmp_path / "port"
    server = subprocess.Popen([sys.executable, "-c", (
        "import datetime, pathlib, time\n"
        "from torch.distributed import TCPStore\n"
        "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
        f"pathlib.Path({str(port_file)!r}).write_text(str(s.port))\n"
        "time.sleep(120)\n"
    )])  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline and server.poll() is None, "store never started"
            time.sleep(0.05)
        client = quorum.connect("127.0.0.1", int(port_file.read_text()), timeout_s=1.0)
        quorum.ensure(client, 2)
        assert quorum.latest(client).members == (0, 1)
        os.kill(server.pid, signal.SIGSTOP)
        # Stopped only once each of its threads took the signal: on a loaded machine the
        # store's thread once answered the read first (the call returned, nothing raised).
        stopped = time.monotonic() + 30
        while not _all_stopped(server.pid):
            assert time.monotonic() < stopped, "the store process did not stop"
            time.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(quorum.QuorumError, match="did not answer"):
            quorum.read(client, 1)
        assert time.monotonic() - t0 < 3.0
        client.close()
    finally:
        server.kill()
        server.wait(timeout=30)


def _epoch(epoch: int, members: list[int], step: int) -> dict[str, object]:
    return {"kind": "quorum_epoch", "generation": 0, "epoch": epoch, "members": members,
            "step": step, "groups": 3, "group_size": 2, "ts": 100.0 + epoch}  # fmt: skip


def test_reduced_width_names_each_step_and_its_missing_batches() -> None:
    ev = [_epoch(0, [0, 1, 2], 0), _epoch(1, [0, 2], 10), _epoch(2, [0, 1, 2], 13)]
    steps = reduced_width(ev, 20)
    assert [s["step"] for s in steps] == [11, 12, 13]
    assert steps[0] == {"step": 11, "width": 2, "missing_groups": [1],
                        "missing_batches": [[11, 2], [11, 3]]}  # fmt: skip
    assert reduced_width([_epoch(0, [0, 1, 2], 0)], 20) == []


def test_a_restart_counts_only_its_own_heal() -> None:
    ev = [
        {"kind": "group_restarted", "generation": 0, "group": 1, "t_fault": 10.0, "ts": 10.1},
        {"kind": "group_restarted", "generation": 0, "group": 1, "t_fault": 12.0, "ts": 12.1},
        {"kind": "group_healed", "generation": 0, "group": 1, "slot": 0, "ts": 14.5,
         "source_group": 0, "step": 40, "bytes": 9, "seconds": 0.1, "epoch": 4},
    ]  # fmt: skip
    first, second = local_recoveries(ev)
    assert first["heal"] is None and second["rejoined_s"] == 2.5


def _all_stopped(pid: int) -> bool:
    """Is every thread of ``pid`` stopped (state T in /proc/PID/task/TID/stat)?"""
    states = [
        (t / "stat").read_text().rsplit(")", 1)[1].split()[0]
        for t in Path(f"/proc/{pid}/task").iterdir()
    ]
    return bool(states) and all(st == "T" for st in states)
