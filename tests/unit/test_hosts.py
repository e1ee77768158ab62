"""``trainguard run --rdzv-endpoint``'s pure parts: the controller's arguments, the token."""

from __future__ import annotations

import socket

import pytest

from trainguard.cli.hosts import controller_argv, derive_token, is_controller, parse_endpoint


def test_the_controller_gets_every_flag_but_runs_own_and_the_script_untouched() -> None:
    argv = [
        "--nnodes", "2", "--rdzv-endpoint", "h:29400", "--node-rank=0", "--tee", "3",
        "--local_addr", "10.0.0.2", "--standby", "1", "--local-ranks-filter=0,1",
        "train.py", "--tee", "x", "--rdzv-endpoint", "kept",
    ]  # fmt: skip
    got = controller_argv(argv, 5)  # the script and its 4 arguments
    assert got == ["--nnodes", "2", "--standby", "1",
                   "train.py", "--tee", "x", "--rdzv-endpoint", "kept"]  # fmt: skip


def test_every_host_derives_the_same_token_and_another_secret_or_endpoint_another() -> None:
    a = derive_token("s" * 32, "node0:29400")
    assert a == derive_token("s" * 32, "node0:29400") and len(a) == 32
    assert int(a, 16) >= 0
    assert a != derive_token("t" * 32, "node0:29400")
    assert a != derive_token("s" * 32, "node0:29401")


@pytest.mark.parametrize("bad", ["node0", ":29400", "node0:", "node0:http", "node0:70000"])
def test_a_malformed_endpoint_is_one_line_naming_the_form(bad: str) -> None:
    with pytest.raises(ValueError, match="give HOST:PORT"):
        parse_endpoint(bad)


def test_the_first_to_bind_runs_the_controller_and_the_next_joins() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.listen()
        assert not is_controller("127.0.0.1", port, None)  # bound here already: join it
    assert is_controller("127.0.0.1", port, None)  # free: this one runs it
    assert is_controller("127.0.0.1", port, 0) and not is_controller("127.0.0.1", port, 1)


def test_one_command_a_host_decides_at_a_time_and_a_dead_holder_frees_the_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decision lock is an abstract Unix socket: a second command waits (here: past a
    shortened deadline, a ValueError naming the fix); closing the first, or its process
    dying however it dies, frees it; nothing is left on disk."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from trainguard.cli import hosts

    # Where a file would be left: this process's temporary dir (names of ours only: the other
    # test worker's processes use it too) and the child's (TMPDIR, this test's own: all).
    tmp, child_tmp = Path(tempfile.gettempdir()), Path(os.environ["TMPDIR"])
    before = {p.name for p in tmp.iterdir() if p.name.startswith("trainguard")}
    monkeypatch.setattr(hosts, "LISTEN_WAIT_S", -29.8)  # a deadline 0.2 s away
    held = hosts._decision_lock("10.9.9.9", 29411)
    with pytest.raises(ValueError, match="--node-rank"):
        hosts._decision_lock("10.9.9.9", 29411)
    held.close()
    hosts._decision_lock("10.9.9.9", 29411).close()
    # held by another process that is then SIGKILLed: free again
    code = (
        "import sys, time; from trainguard.cli import hosts; "
        "lock = hosts._decision_lock('10.9.9.9', 29411); print('held', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        with pytest.raises(ValueError):
            hosts._decision_lock("10.9.9.9", 29411)
    finally:
        child.kill()
        child.wait(timeout=30)
    hosts._decision_lock("10.9.9.9", 29411).close()
    assert {p.name for p in tmp.iterdir() if p.name.startswith("trainguard")} - before == set()
    assert list(child_tmp.iterdir()) == []


def test_bad_host_lines_are_refused_with_the_fix_before_anything_starts() -> None:
    """What trying to break ``--rdzv-endpoint`` found: a second ``--node-rank 0`` at a bound
    endpoint (it joined the running job's agents to its own failing controller), an endpoint
    that is not this host's with ``--node-rank 0``, a negative rank, an unresolvable host, a
    ``--local-addr`` of another host, a secret that is not text."""
    from trainguard.cli import hosts

    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        bound.listen()
        port = bound.getsockname()[1]
        with pytest.raises(ValueError, match="in use already.*--node-rank R > 0"):
            hosts.is_controller("127.0.0.1", port, 0)
        assert hosts.is_controller("127.0.0.1", port, None) is False  # joins it
        assert hosts.is_controller("127.0.0.1", port, 1) is False
    with pytest.raises(ValueError, match="not an address of this host"):
        hosts.is_controller("192.0.2.1", 29400, 0)  # TEST-NET-1: never this host's
    with pytest.raises(ValueError, match="--node-rank -1"):
        hosts.is_controller("127.0.0.1", 29400, -1)
    with pytest.raises(ValueError, match="cannot resolve"):
        hosts.local_addr("nosuch.invalid", 29400)
    with pytest.raises(ValueError, match="--local-addr 192.0.2.1: not an address of this host"):
        hosts.check_local_addr("192.0.2.1")
    hosts.check_local_addr("127.0.0.2")  # loopback's /8 is this host's
    with pytest.raises(ValueError, match="TRAINGUARD_SECRET"):
        hosts.derive_token("\udcff\udcfe0123456789abcdef", "127.0.0.1:29400")
    # every spelling of the endpoint's host gives the same token once resolved
    assert hosts.resolve("localhost") == hosts.resolve("127.0.0.1") == "127.0.0.1"


@pytest.mark.parametrize(
    ("flag", "full"), [("--node-r", "--node-rank"), ("--rdzv-end", "--rdzv-endpoint")]
)
def test_an_abbreviated_flag_is_refused_with_its_full_name(
    flag: str, full: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse took ``--node-r 1`` for ``--node-rank 1``; the split that forwards the other
    flags to the controller works by full names, so the controller refused it, after the
    host had started. Now refused at once, in one line naming the flag."""
    from trainguard.cli.main import _parser

    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["run", "--nnodes", "2", flag, "1", "train.py"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"did you mean {full}?" in err and len(err.splitlines()) == 1
