"""Bad input gets one line naming the problem and the fix, exit 2, before anything starts."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import GPT, trainguard_cmd


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(trainguard_cmd(*args), capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "no/such/script.py"], "script 'no/such/script.py' not found"),
        (
            ["run", "--inject", "kill:rank=1", str(GPT)],
            "--inject 'kill:rank=1': kill takes kill:rank=…:step=…",
        ),
        (["run", "--inject", "melt:rank=1:step=2", str(GPT)], "unknown kind 'melt'"),
        (["run", "--nodes", "0", str(GPT)], "--nodes 0: a job needs at least 1 node"),
        (
            ["run", "--nodes", "2", "--inject", "kill:rank=5:step=1", str(GPT)],
            "rank out of range 0..1",
        ),
        (["run", "--hang-timeout", "-1", str(GPT)], "--hang-timeout -1.0"),
    ],
)
def test_bad_flags(tmp_path: Path, args: list[str], needle: str) -> None:
    run_dir = tmp_path / "run"
    res = _run(*args[:1], "--run-dir", str(run_dir), *args[1:])
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainguard: error: "), res.stderr
    assert needle in lines[0]
    assert not run_dir.exists()  # nothing started, nothing written


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--master-port", "29500"], "--master-port: the controller picks rank 0's store"),
        (["run", "--standby", "two"], "argument --standby: invalid int value: 'two'"),
        (["run", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        # a typo: the flag, command or value meant (difflib's close match)
        (["run", "--nprocs-per-node", "2"], "--nprocs-per-node; did you mean --nproc-per-node?"),
        (["run", "--nodes", "1", "--inejct", "kill:rank=0:step=3"], "did you mean --inject?"),
        (["rnu"], "invalid choice: 'rnu' (choose from 'run', "),
        (["rnu"], "; did you mean run?"),
        (["run", "--preflight", "quik"], "; did you mean quick?"),
        (["report", "--run-dir", ".", "--jsno"], "did you mean --json?"),
    ],
)
def test_argparse_errors_are_one_line_too(tmp_path: Path, args: list[str], needle: str) -> None:
    """Refused torchrun flags, a flag without its value, an unknown flag or command: one
    line with the problem and where the flags are listed, not the whole usage text."""
    res = subprocess.run(
        trainguard_cmd(*args, str(GPT)) if args[0] == "run" else trainguard_cmd(*args),
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "--help)" in lines[0], res.stderr


def test_unwritable_run_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should be")
    res = _run("run", "--run-dir", str(blocker / "run"), str(GPT))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"trainguard: error: run dir {blocker / 'run'} is not writable (Not a directory); "
        "pass --run-dir to a writable place"
    ]


def test_bad_config_file_and_report_of_nothing(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("hang_timeot_s = 3\n")
    res = _run("run", "--run-dir", str(tmp_path / "r"), "--config", str(cfg), str(GPT))
    assert res.returncode == 2 and "unknown field(s) hang_timeot_s" in res.stderr
    res = _run("report", "--run-dir", str(tmp_path))
    assert res.returncode == 2 and "no trainguard store here" in res.stderr


def test_two_runs_cannot_share_a_run_dir(tmp_path: Path) -> None:
    import fcntl

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / ".lock", "a+") as held:  # what a live `trainguard run` holds
        fcntl.flock(held, fcntl.LOCK_EX)
        res = _run("run", "--run-dir", str(run_dir), str(GPT))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"trainguard: error: run dir {run_dir.resolve()} is in use by another trainguard run; "
        "pass another --run-dir, or wait for that job to end"
    ]


def test_config_file_values_apply_and_bad_types_are_one_line(tmp_path: Path) -> None:
    from trainguard.cli.main import _parser
    from trainguard.cli.run import build_config

    cfg = tmp_path / "c.toml"
    cfg.write_text("nodes = 2\nstandby = 1\nnproc_per_node = 2\n")
    job = build_config(
        _parser().parse_args(
            ["run", "--run-dir", str(tmp_path / "r"), "--config", str(cfg), str(GPT)]
        )
    )
    assert (job.nodes, job.standby, job.nproc_per_node) == (2, 1, 2)
    job = build_config(
        _parser().parse_args(
            [
                "run",
                "--run-dir",
                str(tmp_path / "r"),
                "--config",
                str(cfg),
                "--nodes",
                "3",
                str(GPT),
            ]
        )
    )
    assert job.nodes == 3  # a flag given beats the file
    cfg.write_text('heartbeat_s = "fast"\n')
    res = _run("run", "--run-dir", str(tmp_path / "r2"), "--config", str(cfg), str(GPT))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert 'heartbeat_s = "fast" is a string; heartbeat_s takes a number' in res.stderr
    (tmp_path / "r3").mkdir()
    (tmp_path / "r3" / "job.sqlite").write_bytes(b"garbage" * 100)
    res = _run("report", "--run-dir", str(tmp_path / "r3"))
    assert res.returncode == 2 and "is not a readable trainguard store" in res.stderr


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("nodes = 2.5", "nodes = 2.5 is a float; nodes takes an integer"),
        (
            'memory_tier = "false"',
            'memory_tier = "false" is a string; memory_tier takes true or false',
        ),
        ("nodes = true", "nodes = true is a boolean; nodes takes an integer"),
        ('preflight = "fast"', "preflight='fast': use quick, full or off"),
    ],
)
def test_config_values_of_the_wrong_type_are_one_line(
    tmp_path: Path, toml: str, needle: str
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml + "\n")
    res = _run("run", "--run-dir", str(tmp_path / "r"), "--config", str(cfg), str(GPT))
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainguard: error: "), res.stderr
    assert needle in lines[0]


def test_an_agent_without_its_controller_gives_up_in_bounded_time(tmp_path: Path) -> None:
    """Issue 13, property 6: nothing waits forever. A real agent whose controller is gone
    (nothing listens on its port) exits with status 3 and the reason after --give-up-after."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nobody listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = tmp_path / "token"
    token.write_text("ab" * 16)
    t0 = time.monotonic()
    res = subprocess.run(
        trainguard_cmd("agent", "--controller", f"127.0.0.1:{port}", "--token-file", token,
                       "--node-id", "n0", "--advertise-addr", "127.0.0.1", "--run-dir",
                       tmp_path / "run", "--give-up-after", "2"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 3, res.stderr[-2000:]
    assert "no contact with controller" in res.stderr and time.monotonic() - t0 < 45


def test_a_run_dir_of_a_newer_format_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """A store written by a newer trainguard (a higher SQLite user_version): `run`, `report`
    and `events` each end with one line naming it and the fix; the file is not touched. One of
    an older format (user_version 0, before formats were numbered) is read."""
    import hashlib
    import sqlite3

    from trainguard.controller.store import FORMAT, Store

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    Store(run_dir).close()  # a real store of this version ...
    db = sqlite3.connect(run_dir / "job.sqlite")
    db.execute(f"PRAGMA user_version = {FORMAT + 1}")  # ... as a newer version would leave it
    db.close()
    before = hashlib.sha256((run_dir / "job.sqlite").read_bytes()).hexdigest()
    for args in (["run", "--run-dir", str(run_dir), str(GPT)],
                 ["report", "--run-dir", str(run_dir)], ["events", "--run-dir", str(run_dir)]):  # fmt: skip
        res = _run(*args)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1, (args, res.stderr)
        assert f"store format {FORMAT + 1}" in lines[0] and "pass another --run-dir" in lines[0]
    assert hashlib.sha256((run_dir / "job.sqlite").read_bytes()).hexdigest() == before
    db = sqlite3.connect(run_dir / "job.sqlite")
    db.execute("PRAGMA user_version = 0")  # a store written before formats were numbered
    db.close()
    res = _run("report", "--run-dir", str(run_dir))
    assert res.returncode == 0, res.stderr


def test_an_agent_advertising_a_loopback_address_to_a_remote_controller_is_refused(
    tmp_path: Path,
) -> None:
    """Debian's ``hostname -i`` is 127.0.1.1: an agent that advertised it would join a
    controller on another host and never be reached. Refused before anything starts, with the
    fix; a loopback address beside a loopback controller (one machine) is fine."""
    token = tmp_path / "token"
    token.write_text("ab" * 16)
    run_dir = tmp_path / "run"
    res = _run("agent", "--controller", "10.0.0.5:8470", "--token-file", str(token),
               "--advertise-addr", "127.0.1.1", "--run-dir", str(run_dir))  # fmt: skip
    assert res.returncode == 2
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("trainguard: error: --advertise-addr 127.0.1.1 is a loopback address")
    assert "hostname -I" in line and not run_dir.exists()
    from trainguard.cli.main import check_advertise

    check_advertise("127.0.0.1:8470", "127.0.0.2")  # simulated hosts on one machine
    check_advertise("10.0.0.5:8470", "10.0.0.7")
