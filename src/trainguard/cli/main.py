"""``trainguard`` command line: run, controller, agent, check, status, ckpt, events, report,
chaos.

Every bad input ends in one line ``trainguard: error: <problem>; <fix>`` and exit
status 2, before any process starts.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import re
import signal
import socket
import sqlite3
import sys
import typing
from pathlib import Path
from typing import Any, NoReturn

from trainguard import __version__
from trainguard.cli.chaos import chaos_parser
from trainguard.controller.config import PreflightLevel, field_of
from trainguard.faults.inject import KINDS as INJECT_KINDS


class _Refuse(argparse.Action):
    """A torchrun flag this command does not take: exit 2 with why and what to use instead."""

    def __init__(self, option_strings: list[str], dest: str, why: str = "", **kw: object) -> None:
        self.why = why
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS)

    def __call__(self, parser: argparse.ArgumentParser, *_: object, **__: object) -> None:
        parser.error(f"{'/'.join(self.option_strings[:1])}: {self.why}")


def torchrun_flags(p: argparse.ArgumentParser, *, multi_host: bool) -> None:
    """torchrun's launch flags where they mean something here (``-m``, ``--no-python``, the
    console and log flags, ``--standalone``), and a one-line explanation for the others."""
    p.add_argument("-m", "--module", action="store_true",
                   help="SCRIPT is a module, run as python -m (torchrun -m)")  # fmt: skip
    p.add_argument("--no-python", "--no_python", action="store_true",
                   help="SCRIPT is a program run as it is, not a Python file")  # fmt: skip
    p.add_argument("--standalone", action="store_true",
                   help="accepted for torchrun scripts (trainguard runs its own rendezvous; no etcd or "
                        "c10d endpoint is needed)")  # fmt: skip
    names, kw = _field_flag("log_dir", "--log_dir", shown="", type=Path, default=None)
    p.add_argument(*names, **kw)
    if multi_host:
        return _refuse(p, multi_host)
    p.add_argument("--tee", "-t", default=None, metavar="0-3",
                   help="show every rank's output on the console, prefixed [rankN]: "
                        "(torchrun's stream codes; both streams go to one log here)")  # fmt: skip
    p.add_argument("--local-ranks-filter", "--local_ranks_filter", default=None, metavar="LIST",
                   help="ranks whose output the console shows, e.g. 0,3 or none (default 0)")  # fmt: skip
    _refuse(p, multi_host)


def _refuse(p: argparse.ArgumentParser, multi_host: bool) -> None:
    refused = {
        ("--rdzv-backend", "--rdzv_backend"): "the controller is the rendezvous: none to choose",
        ("--rdzv-id", "--rdzv_id"): "a job is named by its --run-dir",
        ("--rdzv-conf", "--rdzv_conf"): "set JobConfig fields in --config FILE instead",
        ("--master-addr", "--master_addr"): "the controller picks rank 0's store each generation",
        ("--master-port", "--master_port"): "the controller picks rank 0's store each generation",
        ("--node-rank", "--node_rank"): "node ranks are assigned by the controller (pools)",
        ("--start-method", "--start_method"): "workers start from warm spares (python SCRIPT)",
        ("--monitor-interval", "--monitor_interval"): "set heartbeat_s in --config FILE",
        ("--redirects", "-r"): "every rank's output goes to its log; --tee shows it",
        ("--role",): "one role per job",
    }
    if not multi_host:  # run: the same command on every host (cli/hosts.py)
        del refused[("--node-rank", "--node_rank")]
        p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST:PORT",
                       help="across hosts: the same command on each, as with torchrun; the "
                            "first to bind HOST:PORT runs the controller (needs "
                            "$TRAINGUARD_SECRET, the same on every host; docs/deploy.md)")  # fmt: skip
        p.add_argument("--node-rank", "--node_rank", type=int, default=None, metavar="R",
                       help="with --rdzv-endpoint: 0 = this host runs the controller, > 0 = "
                            "it only joins (default: the first to bind the endpoint)")  # fmt: skip
        p.add_argument("--local-addr", "--local_addr", default=None, metavar="ADDR",
                       help="with --rdzv-endpoint: the address other hosts reach this one at "
                            "(default: this host's address on the route to the endpoint)")  # fmt: skip
    for names, why in refused.items():
        p.add_argument(*names, action=_Refuse, why=why)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the problem and where the flags are listed, not the
    whole usage text (a wrong flag among a job's many scrolls the reason off the screen).
    No abbreviations (``--node-r`` for ``--node-rank``): a prefix that this parser accepted
    would reach the parts it forwards flags to by their full names, and be refused there."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        hint = self._did_you_mean(message)
        self.exit(2, f"{self.prog}: error: {message}{hint} (see {self.prog} --help)\n")

    def _did_you_mean(self, message: str) -> str:
        """'; did you mean --x?' for a mistyped flag or command (difflib's close matches
        among this parser's and its subcommands' flags, or the choices offered)."""
        if m := re.match(r"unrecognized arguments: (.*)", message):
            known = self._flags()
            words = [w.split("=", 1)[0] for w in m.group(1).split() if w.startswith("-")]
        elif m := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message):
            known, words = re.findall(r"'([^']*)'", m.group(2)), [m.group(1)]
        else:
            return ""
        hints = [(w, close[0]) for w in words if (close := _close(w, known))]  # fmt: skip
        if len(words) == 1 and hints:
            return f"; did you mean {hints[0][1]}?"
        return f"; did you mean {', '.join(f'{c} (for {w})' for w, c in hints)}?" if hints else ""

    def _flags(self) -> list[str]:
        """Every option string of this parser and of its subcommands' parsers."""
        out = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    out += list(sub._option_string_actions)
        return out


def _close(word: str, known: list[str]) -> list[str]:
    """The flags ``word`` may mean: those it abbreviates (the shortest first), else difflib's
    close matches."""
    prefixed = sorted((k for k in known if k.startswith(word) and len(word) > 2), key=len)
    return prefixed or difflib.get_close_matches(word, known, n=1, cutoff=0.6)


Flag = tuple[tuple[str, ...], dict[str, Any]]  # names, add_argument keywords


def _field_flag(name: str, *aliases: str, shown: str | None = None, **kw: Any) -> Flag:
    """The flag that sets config field ``name`` (its flat name): the flag's name and help
    from the field (``controller/config.py``), the help ending in the field's default (or
    ``shown``)."""
    f = field_of(name)
    shown = f"(default {f.default})" if shown is None else shown
    help_ = " ".join(t for t in (f.metadata["doc"], shown) if t)
    return (f.metadata["flag"], *aliases), {"help": help_, **kw}


_CALIBRATED = "(default: calibrated from step times, {:g} s to {:g} s)".format(
    field_of("hang_timeout_min_s").default, field_of("hang_timeout_max_s").default
)
# The job flags of ``run`` and ``controller``, declared once. Those that set a config field
# take its name and doc; ``cli/run.py: build_config`` puts their values in the config.
_JOB_FLAGS: tuple[Flag, ...] = (
    _field_flag("nodes", "--nnodes", shown="(default 1); MIN:MAX = elastic", default=None,
                metavar="N|MIN:MAX"),
    _field_flag("standby", type=int, default=None),
    _field_flag("nproc_per_node", "--nproc_per_node", default=None,
                shown="(default 1); auto = one per GPU, else per CPU core", metavar="N|auto"),
    (("--run-dir", "--run_dir"),
     dict(type=Path, default=None, help="run directory (default runs/<timestamp>)")),
    _field_flag("max_restarts", "--max_restarts", type=int, default=None),
    _field_flag("replica_groups", "--replica_groups", type=int, default=None, metavar="G"),
)  # fmt: skip
_JOB_FLAGS_AFTER: tuple[Flag, ...] = (
    _field_flag("preflight", choices=list(typing.get_args(PreflightLevel)), default=None),
    _field_flag("hang_timeout_s", "--hang_timeout", shown=_CALIBRATED, type=float, default=None,
                metavar="SECONDS"),
    _field_flag("injects", action="append", default=[], metavar="SPEC",
                help=f"fault drill, e.g. kill:rank=1:step=20 ({'|'.join(INJECT_KINDS)}; "
                     "docs/drills.md)"),
    (("--config",),
     dict(type=Path, default=None, help="TOML file of further job config fields (docs/config.md)")),
    (("script",), dict(help="training script (Python)")),
    (("script_args",), dict(nargs=argparse.REMAINDER, help="its arguments")),
)  # fmt: skip
# What the flags above say differently when agents run on other hosts.
_MULTI_HOST_HELP = {
    "--run-dir": "run directory (shared storage)",
    "script": "training script (Python), the same path on every host",
}


def _add_job_flags(p: argparse.ArgumentParser, *, multi_host: bool, extra: Any = None) -> None:
    """The job flags, then ``extra(p)`` (the command's own), the torchrun flags, the rest."""

    def add(table: tuple[Flag, ...]) -> None:
        for names, kw in table:
            if multi_host and names[0] in _MULTI_HOST_HELP:
                kw = {**kw, "help": _MULTI_HOST_HELP[names[0]]}
            p.add_argument(*names, **kw)

    add(_JOB_FLAGS)
    if extra is not None:
        extra(p)
    torchrun_flags(p, multi_host=multi_host)
    add(_JOB_FLAGS_AFTER)


def _controller_flags(k: argparse.ArgumentParser) -> None:
    k.add_argument(
        "--bind",
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="listen here (default 127.0.0.1:0); agents join with --controller HOST:PORT",
    )
    k.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="job token (default RUN_DIR/token, made if missing)",
    )


def _agent_parser(a: argparse.ArgumentParser) -> None:
    a.add_argument("--controller", required=True, metavar="HOST:PORT")
    a.add_argument("--token-file", type=Path, required=True)
    a.add_argument("--node-id", default=None, help="this node's name (default: the hostname)")
    a.add_argument(
        "--advertise-addr",
        "--addr",
        dest="addr",
        required=True,
        help="address workers and peers reach this node at",
    )
    a.add_argument("--run-dir", type=Path, required=True, help="the job's run dir (shared storage)")
    a.add_argument(
        "--give-up-after",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="without controller contact this long: stop workers, free slots, exit 3 (default 600)",
    )
    a.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    a.add_argument("--tee", action="store_true",
                   help="print its workers' output on stdout, prefixed [rankN]: (torchrun --tee)")  # fmt: skip
    a.add_argument(
        "--relay",
        default=None,
        metavar="HOST:PORT",
        help="report through this relay (trainguard relay, one per rack); directly to the "
        "controller while it does not answer",
    )


def _relay_parser(a: argparse.ArgumentParser) -> None:
    a.add_argument("--controller", required=True, metavar="HOST:PORT")
    a.add_argument("--token-file", type=Path, required=True, help="the job token (RUN_DIR/token)")
    a.add_argument("--bind", default="0.0.0.0:0", metavar="HOST:PORT",
                   help="where its agents reach it (port 0: any free one, printed)")  # fmt: skip
    a.add_argument("--relay-id", default=None, help="its name in events (default: the hostname)")
    a.add_argument("--flush", type=float, default=0.25, metavar="SECONDS",
                   help="period of the alive summaries sent to the controller (default 0.25)")  # fmt: skip


def _check_parser(h: argparse.ArgumentParser) -> None:
    h.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="simulated nodes to check (default 4), or agents to wait for with --bind",
    )
    h.add_argument(
        "--controller", default=None, metavar="HOST:PORT", help="check a live job's idle nodes"
    )
    h.add_argument("--bind", default=None, metavar="HOST:PORT", help="wait for real agents here")
    h.add_argument("--level", choices=["quick", "full"], default=None, help="default quick")
    h.add_argument("--json", action="store_true", help="machine-readable output")
    h.add_argument(
        "--run-dir", type=Path, default=None, help="where results go (default runs/check-<time>)"
    )
    h.add_argument("--token-file", type=Path, default=None, help="default RUN_DIR/token")
    h.add_argument(
        "--config", type=Path, default=None, help="TOML file of CheckConfig fields (thresholds)"
    )
    h.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="drill, e.g. gemm-wrong:node=2",
    )
    h.add_argument(
        "--join-timeout", type=float, default=120.0, metavar="SECONDS", help=argparse.SUPPRESS
    )


def _reading_parsers(sub: Any) -> None:
    """The commands that read a run: status, ckpt, events, report."""
    t = sub.add_parser("status", help="a live job's phase, node lists and nodes")
    t.add_argument("--controller", default=None, metavar="HOST:PORT")
    t.add_argument("--run-dir", type=Path, default=None)
    t.add_argument("--token-file", type=Path, default=None, help="default RUN_DIR/token")
    t.add_argument("--json", action="store_true")

    o = sub.add_parser("stop", help="a planned stop of a live job: snapshots saved, then stopped")
    o.add_argument("--controller", default=None, metavar="HOST:PORT")
    o.add_argument("--run-dir", type=Path, default=None)
    o.add_argument("--token-file", type=Path, default=None, help="default RUN_DIR/token")
    o.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for the job to end (default: return at once)")  # fmt: skip

    c = sub.add_parser("ckpt", help="list, verify or export a run's checkpoints")
    c.add_argument("action", choices=["ls", "verify", "export"])
    c.add_argument("--run-dir", type=Path, required=True)
    c.add_argument("--json", action="store_true", help="machine-readable output (ls, verify)")
    c.add_argument(
        "--step", type=int, default=None, help="export: the step (default: newest verified)"
    )
    c.add_argument("--out", type=Path, default=Path("checkpoint.pt"), help="export: output file")
    c.add_argument(
        "--format", choices=["torch", "safetensors"], default="torch", help="export: file format"
    )

    for name, what in (
        ("events", "list a job's events"),
        ("report", "summarize a job: steps, faults, recoveries, goodput"),
    ):
        e = sub.add_parser(name, help=what)
        e.add_argument("--run-dir", type=Path, required=True)
        e.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "report":
            e.add_argument(
                "--html", type=Path, default=None, metavar="FILE",
                help="also write one self-contained HTML file (charts, recovery timeline, "
                "goodput breakdown) for a post-mortem",
            )  # fmt: skip
        if name == "events":
            e.add_argument(
                "--kind", action="append", default=None, help="only this kind (repeatable)"
            )
            e.add_argument("--all", action="store_true", help="include routine checkpoint events")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="trainguard", description="Keep PyTorch training jobs running through faults.")
    p.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    r = sub.add_parser("run", help="run a training job on this machine with simulated nodes")
    _add_job_flags(r, multi_host=False)
    k = sub.add_parser("controller", help="run a job's controller for agents on other hosts")
    _add_job_flags(k, multi_host=True, extra=_controller_flags)
    _agent_parser(sub.add_parser("agent", help="run a node agent (one per host)"))
    _relay_parser(
        sub.add_parser("relay", help="run a relay: a rack's agents report through it (at scale)")
    )
    _check_parser(
        sub.add_parser("check", help="pre-flight node checks: host, GEMM, collectives, training")
    )
    _reading_parsers(sub)
    chaos_parser(
        sub.add_parser("chaos", help="the GPT example under random faults, then a fault-free run")
    )
    return p


# Commands that print and exit: a reader that stops early (``| head``) ends them quietly,
# as it ends any Unix filter. Long-running ones (run, controller, agent, check) keep Python's
# SIGPIPE-ignored default, so a closed socket is an error they handle, never their death.
_PRINTING = frozenset({"status", "events", "report", "ckpt"})


def _token(path: Path) -> str:
    """The job token in ``path``. Raises ValueError naming the file if it holds none."""
    token = path.read_text().strip()
    try:
        if len(bytes.fromhex(token)) < 8:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"--token-file {path}: not a trainguard job token; pass the token file the "
            "controller wrote (RUN_DIR/token)"
        ) from None
    return token


def check_advertise(controller: str, addr: str) -> None:
    """Refuse an ``--advertise-addr`` that the controller's host cannot reach: a loopback
    address (127.0.0.0/8, ::1) while the controller is not on loopback. Debian's
    ``hostname -i`` gives 127.0.1.1 (its /etc/hosts entry for the hostname), so a script that
    advertises ``$(hostname -i)`` would join and never be reached. Raises ValueError with the
    fix."""
    import ipaddress

    def loopback(host: str) -> bool:
        with contextlib.suppress(ValueError):
            return ipaddress.ip_address(host.strip("[]")).is_loopback
        return host == "localhost"

    ctl_host = controller.rpartition(":")[0] or controller
    if loopback(addr) and not loopback(ctl_host):
        raise ValueError(
            f"--advertise-addr {addr} is a loopback address, which the controller at "
            f"{controller} and the other hosts cannot reach (Debian's hostname -i gives "
            "127.0.1.1); pass this host's address on their network, e.g. "
            "$(hostname -I | cut -d' ' -f1)"
        )


# Commands that are one function of their arguments: (module, function), imported when run
# (``import trainguard`` stays cheap: torch is imported only by those that need it).
_COMMANDS = {
    "run": ("trainguard.cli.run", "run_command"),
    "controller": ("trainguard.cli.controller", "controller_command"),
    "check": ("trainguard.cli.check", "check_command"),
    "status": ("trainguard.cli.status", "status_command"),
    "stop": ("trainguard.cli.status", "stop_command"),
    "chaos": ("trainguard.cli.chaos", "chaos_command"),
    "ckpt": ("trainguard.cli.ckpt", "main"),
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.cmd in _PRINTING:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        if args.cmd in _COMMANDS:  # a module's function of args, imported when used
            module, name = _COMMANDS[args.cmd]
            return int(getattr(importlib.import_module(module), name)(args))
        if args.cmd == "relay":
            from trainguard.relay.server import main as relay_main

            if args.flush <= 0:
                raise ValueError(f"--flush {args.flush}: a period in seconds, > 0")
            return relay_main(
                controller=args.controller,
                token=_token(args.token_file),
                relay_id=args.relay_id or socket.gethostname().split(".")[0],
                bind=args.bind,
                flush_s=args.flush,
            )
        if args.cmd == "agent":
            from trainguard.agent.agent import AgentConfig
            from trainguard.agent.agent import main as agent_main

            token = _token(args.token_file)
            check_advertise(args.controller, args.addr)
            return agent_main(
                AgentConfig(
                    controller=args.controller,
                    token=token,
                    node_id=args.node_id or socket.gethostname().split(".")[0],
                    addr=args.addr,
                    run_dir=args.run_dir,
                    exit_with_parent=args.exit_with_parent,
                    give_up_s=args.give_up_after if args.give_up_after > 0 else None,
                    relay=args.relay,
                    tee=args.tee,
                )
            )
        from trainguard.observe import report

        if args.cmd == "events":
            return report.print_events(
                args.run_dir, as_json=args.json, kinds=args.kind, everything=args.all
            )
        if args.html is not None:
            from trainguard.observe.html import write_report

            print(f"wrote {write_report(args.run_dir, args.html)}", file=sys.stderr)
        return report.print_report(args.run_dir, as_json=args.json)
    except (ValueError, FileNotFoundError, PermissionError, NotADirectoryError) as e:
        print(f"trainguard: error: {e}", file=sys.stderr)
        return 2
    except sqlite3.DatabaseError as e:
        where = getattr(args, "run_dir", None)
        print(
            f"trainguard: error: {where}/job.sqlite is not a readable trainguard store ({e}); "
            "pass the --run-dir of a job, or move the damaged file away to start afresh",
            file=sys.stderr,
        )
        return 2
