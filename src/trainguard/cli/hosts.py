"""``trainguard run --rdzv-endpoint HOST:PORT``: the same command on every host, as with torchrun.

    export TRAINGUARD_SECRET=...            # the same on every host (srun passes it on)
    trainguard run --nnodes 2 --nproc-per-node 8 --rdzv-endpoint node0:29400 train.py

On each host the command decides its part:

- **the controller's host**: the first to bind HOST:PORT (or ``--node-rank 0``) runs the job's
  controller there (``trainguard controller``, the same flags) and an agent;
- **every other host** (``--node-rank R`` > 0, or the endpoint already bound or not an address of
  this host) runs an agent that joins the controller at HOST:PORT.

The job token is never written to any file: every host derives it from the secret
(HMAC-SHA256 of the endpoint under ``$TRAINGUARD_SECRET``) and hands it to its controller and
agent through a pipe each (``--token-file /dev/fd/N``), so a host killed with SIGKILL leaves
nothing behind. An agent whose secret differs from the controller's host's is refused (401);
it says so and exits (status 2) after ``WRONG_SECRET_S``. Each host's agent is started with ``--tee``: the
host's console shows its own ranks' output, each line prefixed ``[rankN]:`` (torchrun's
``--tee``). The agent advertises the address this host reaches the endpoint from (never
127.0.1.1, Debian's ``hostname -i``); ``--local-addr`` names another. Without ``--run-dir``
every host uses ``runs/rdzv-HOST-PORT``.

Exit status: the controller's host returns the job's (``trainguard controller``); another host
its agent's (0 once the job ended; 128+signal when this command was stopped by SIGTERM/SIGINT). SIGTERM/SIGINT are passed to the children.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import hashlib
import hmac
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from trainguard.runtime.api import ENV_SECRET, ENV_TOKEN_SOURCE
from trainguard.runtime.process import die_with_parent

AGENT_GRACE_S = 60.0  # after the controller ends: its agent's time to see that and exit
LISTEN_WAIT_S = 120.0  # the controller's time to listen (a torch import, its store) on this host
# `trainguard run` flags that the controller does not take (value-taking ones: True)
_RUN_ONLY = {
    "--rdzv-endpoint": True, "--rdzv_endpoint": True, "--node-rank": True, "--node_rank": True,
    "--local-addr": True, "--local_addr": True, "--tee": True, "-t": True,
    "--local-ranks-filter": True, "--local_ranks_filter": True,
}  # fmt: skip


def derive_token(secret: str, endpoint: str) -> str:
    """The job token (32 hex digits) every host derives from the shared secret and the
    endpoint (``ADDRESS:PORT``: ``resolve`` it first, so that every spelling of the host
    gives the same token). Raises ValueError for a secret that is not text."""
    try:
        key = secret.encode()
    except UnicodeEncodeError:
        raise ValueError(
            f"${ENV_SECRET} is not valid text in this locale; use letters and digits "
            "(e.g. openssl rand -hex 16)"
        ) from None
    return hmac.new(key, f"trainguard job {endpoint}".encode(), hashlib.sha256).hexdigest()[:32]


def resolve(host: str) -> str:
    """The IPv4 address ``host`` names. Raises ValueError naming the fix."""
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError) as e:
        raise ValueError(
            f"--rdzv-endpoint {host}: cannot resolve it ({e}); give its address"
        ) from None


def parse_endpoint(text: str) -> tuple[str, int]:
    """HOST:PORT of ``--rdzv-endpoint``. Raises ValueError naming the form."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"--rdzv-endpoint {text!r}: give HOST:PORT of the first host, e.g. node0:29400"
        )
    return host.strip("[]"), int(port)


def is_controller(host: str, port: int, node_rank: int | None) -> bool:
    """Does this host run the controller? ``--node-rank`` says so; without it, whoever binds
    the endpoint first (another host's address, or one already bound here: an agent).
    Raises ValueError for ``--node-rank 0`` where the endpoint is bound already (a second
    controller would take the running job's agents, then fail) or is not an address of this
    host, and for a negative rank."""
    if node_rank is not None and node_rank < 0:
        raise ValueError(f"--node-rank {node_rank}: 0 for the controller's host, else > 0")
    if node_rank is not None and node_rank > 0:
        return False
    addr = resolve(host)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as e:
            if node_rank == 0 and e.errno == errno.EADDRINUSE:
                raise ValueError(
                    f"--node-rank 0: {host}:{port} is in use already (a controller of this "
                    "job or another runs there); give this host --node-rank R > 0 to join, or "
                    "another --rdzv-endpoint port"
                ) from None
            if node_rank == 0 and e.errno == errno.EADDRNOTAVAIL:
                raise ValueError(
                    f"--node-rank 0: {host} ({addr}) is not an address of this host; run the "
                    "controller's line on that host, or give this one --node-rank R > 0"
                ) from None
            if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                return False
            raise
    return True


def local_addr(host: str, port: int) -> str:
    """The address this host reaches ``host`` from (the route's source; nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((resolve(host), port))
        return str(s.getsockname()[0])


def check_local_addr(addr: str) -> None:
    """Raise ValueError unless ``addr`` is an address of this host (``--local-addr``)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((addr, 0))
    except (OSError, UnicodeError) as e:
        raise ValueError(
            f"--local-addr {addr}: not an address of this host ({e}); give one of its own "
            "(ip -4 addr), or leave it out to use the route's source address"
        ) from None


def controller_argv(argv: list[str], n_script: int) -> list[str]:
    """``trainguard run``'s arguments without the flags only ``run`` takes; the last
    ``n_script`` (SCRIPT and its arguments) are kept as they are."""
    flags, script = argv[: len(argv) - n_script], argv[len(argv) - n_script :]
    out: list[str] = []
    i = 0
    while i < len(flags):
        a = flags[i]
        if a.split("=", 1)[0] in _RUN_ONLY:
            i += 1 if "=" in a else 2
            continue
        out.append(a)
        i += 1
    return out + script


def run_on_hosts(args: argparse.Namespace, argv: list[str]) -> int:
    """Play this host's part (module docstring). Raises ValueError naming the fix."""
    secret = os.environ.get(ENV_SECRET, "")
    if len(secret) < 16:
        raise ValueError(
            f"a job across hosts needs a shared secret of 16+ characters in ${ENV_SECRET} on every "
            f"host (export {ENV_SECRET}=$(openssl rand -hex 16) before srun/ssh: the job token is "
            "derived from it, never written to shared storage)"
        )
    host, port = parse_endpoint(args.rdzv_endpoint)
    # Several of these commands on one host (srun's tasks on a node, simulated nodes) decide
    # one at a time, the controller's host until its controller listens: two cannot both
    # find the endpoint free.
    decide = _decision_lock(host, port)
    controller = is_controller(host, port, args.node_rank)
    if not controller:
        decide.close()
    if args.local_addr:
        check_local_addr(args.local_addr)
    addr = args.local_addr or local_addr(host, port)
    if args.run_dir is None:
        args.run_dir = Path("runs") / f"rdzv-{host}-{port}"
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    node_id = f"{socket.gethostname().split('.')[0]}-{addr.replace('.', '-').replace(':', '-')}"
    me = [sys.executable, "-m", "trainguard"]
    token = derive_token(secret, f"{resolve(host)}:{port}")
    # The children get the token, never the secret: no worker can derive another job's.
    env = {k: v for k, v in os.environ.items() if k != ENV_SECRET}
    agent = [*me, "agent", "--controller", f"{host}:{port}", "--advertise-addr", addr,
             "--run-dir", str(run_dir), "--node-id", node_id, "--tee"]  # fmt: skip
    children: list[subprocess.Popen[bytes]] = []

    got: list[int] = []

    def forward(sig: int, _: object) -> None:
        """A signal to this line (a terminal's Ctrl-C reaches only it: its children run in
        sessions of their own) goes to the controller, whose planned stop saves the newest
        snapshot through this host's agent and then ends the job (the agent ends with it);
        on a joining host, to the agent. Sent to the agent too, the agent's node would leave
        at once and the stop would end with the newest durable step instead (seen: 5 steps
        lost to a Ctrl-C)."""
        got.append(sig)
        for c in children[:1] if controller else children:
            with contextlib.suppress(ProcessLookupError):
                c.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    try:
        if controller:
            ctl = [*me, "controller", "--rdzv-endpoint", f"{host}:{port}",
                   "--run-dir", str(run_dir),
                   *controller_argv(argv, 1 + len(args.script_args))]  # fmt: skip
            print(f"trainguard: this host runs the controller at {host}:{port} and node "
                  f"{node_id}", file=sys.stderr, flush=True)  # fmt: skip
            children.append(_with_token(ctl, token, env))
            _wait_listening(host, port, children[0])
            decide.close()
            if children[0].poll() is not None:  # it failed (its one-line error is above):
                return children[0].returncode  # no agent for whoever else answers there
        else:
            print(f"trainguard: this host joins {host}:{port} as node {node_id}",
                  file=sys.stderr, flush=True)  # fmt: skip
        children.append(_with_token(agent, token, {**env, ENV_TOKEN_SOURCE: "secret"}))
        if not controller:  # stopped by a signal: say so (the agent's own exit is then 0)
            code = children[0].wait()
            return 128 + got[0] if got and code == 0 else code
        code = children[0].wait()
        try:  # a job that ended: its agent sees it and exits; a controller that failed
            children[1].wait(timeout=AGENT_GRACE_S if code == 0 else 0.1)
        except subprocess.TimeoutExpired:
            children[1].terminate()
            children[1].wait(timeout=30)
        return code
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()


def _with_token(
    argv: list[str], token: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` (``python -m trainguard SUBCOMMAND …``) with ``--token-file /dev/fd/N``
    after its subcommand: the read end of a pipe holding the token (read once at its start;
    no file, nothing left by a kill). The child gets SIGTERM when this process dies, and
    runs in a session of its own (a terminal's signals reach it only through ``forward``)."""
    r, w = os.pipe()
    try:
        os.write(w, token.encode())
    finally:
        os.close(w)
    try:
        cmd = [*argv[:4], "--token-file", f"/dev/fd/{r}", *argv[4:]]
        # SIGTERM when this command dies, even by SIGKILL: the controller stops the job (its
        # planned stop), the agent its workers; neither outlives the line that started it.
        stop_with_me = functools.partial(die_with_parent, os.getpid(), signal.SIGTERM)
        return subprocess.Popen(
            cmd, pass_fds=(r,), env=env, preexec_fn=stop_with_me, start_new_session=True
        )
    finally:
        os.close(r)


def _wait_listening(host: str, port: int, ctl: subprocess.Popen[bytes]) -> None:
    """Until the controller accepts connections at host:port, it exits, or LISTEN_WAIT_S."""
    deadline = time.monotonic() + LISTEN_WAIT_S
    while time.monotonic() < deadline and ctl.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0):
            return
        time.sleep(0.1)


def _decision_lock(host: str, port: int) -> socket.socket:
    """This host's lock for deciding who runs the controller (held by the controller's host
    until it listens): a Unix socket bound to an abstract name, which the kernel frees when
    its holder exits, however it exits (no file is left), and which is per network namespace
    as a host's addresses are. Raises ValueError past LISTEN_WAIT_S + 30 s."""
    name = f"\0trainguard-rdzv-{host}-{port}"
    decide = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + LISTEN_WAIT_S + 30.0  # the holder waits LISTEN_WAIT_S at most
    while True:
        try:
            decide.bind(name)
            break
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                decide.close()
                raise
            if time.monotonic() > deadline:
                decide.close()
                raise ValueError(
                    f"another trainguard run on this host has been deciding for over "
                    f"{LISTEN_WAIT_S + 30:.0f}s without its controller listening at {host}:{port}; "
                    "is it stuck? stop it, or give this host --node-rank"
                ) from None
            time.sleep(0.1)
    return decide
