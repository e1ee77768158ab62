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
