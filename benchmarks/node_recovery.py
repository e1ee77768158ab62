"""Node loss → first resumed step: restore from a peer replica vs from the durable tier.

Three hosts (network namespaces joined by a bridge; needs root): two run the GPT
example (its default size, one rank each), one is standby. At ``--kill-step`` every
process of the host running node rank 1 is SIGKILLed and its memory (its /dev/shm
slots) dropped, as in a power loss. The standby takes its place; its rank restores
either from the replica the lost host's ckptd kept in its ring peer's memory
(``replicas = true``) or, with replicas off, every rank from the durable tier (the
example persists every ``--durable-every`` steps). Both runs in one invocation; each
recovery phase is printed side by side (seconds, from ``trainguard report --json``).

Keys: ``steps``, ``kill_step``, ``durable_every``, ``model_args`` (the example's model
flags; empty: its defaults), ``replica`` and ``durable`` (each: ``phases_s``,
``restore_step``, ``restore_tiers``, ``steps_lost``; ``later_faults``: faults after the host's
loss, e.g. caused by a loaded machine, each its own recovery). No target is named for these figures.

``--smoke``: the tiny model, 40 steps, the kill at step 20, durable every 10 steps, no
pre-flight screening of the hosts as they join (CI).
``--record`` writes ``benchmarks/results/node_recovery.json`` (``table_rows``). Run (as
root): ``python benchmarks/node_recovery.py [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import common  # noqa: E402
from step_overhead import SMALL, model_text  # noqa: E402  (the example's tiny model)

from trainguard.controller.api import RECOVERY_PHASES  # noqa: E402
from trainguard.faults.netns import Hosts  # noqa: E402

GPT = ROOT / "examples" / "gpt" / "train.py"
CONFIG = """
heartbeat_s = 0.2
node_timeout_s = 3.0
fault_stop_grace_s = 0.1
replicas = {replicas}
{more}"""


def _tg(*args: object) -> list[str]:
    return [sys.executable, "-m", "trainguard", *map(str, args)]


def _reached(run_dir: Path, step: int) -> bool:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return False
    with contextlib.suppress(ValueError):  # a line being written
        return any(json.loads(x)["step"] >= step for x in path.read_text().splitlines() if x)
    return False


def wait_until(pred: Any, timeout: float, what: str) -> Any:
    """``pred()`` once it is truthy; RuntimeError past ``timeout`` seconds (polls every 50 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def _job_tag(run_dir: Path) -> str:
    """The run's tag in its /dev/shm segment names (``trainguard-<tag>-<node>-…``)."""
    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]


def one_run(tmp: Path, replicas: bool, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = tmp / ("replica" if replicas else "durable")
    run_dir.mkdir()
    cfg = tmp / f"{run_dir.name}.toml"
    more = 'preflight = "off"\n' if args.smoke else ""  # the smoke: seconds, not a screening
    cfg.write_text(CONFIG.format(replicas=str(replicas).lower(), more=more))
    job = _job_tag(run_dir)
    hosts = Hosts(3).up()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ctl = subprocess.Popen(
            _tg("controller", "--bind", f"{hosts.gateway}:0", "--run-dir", run_dir,
                "--config", cfg, "--nodes", "2", "--standby", "1", GPT,
                "--steps", args.steps, "--durable-every", args.durable_every, *args.model_args),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT,
        )  # fmt: skip
        procs.append(ctl)
        info = run_dir / "controller.json"
        wait_until(info.exists, 60, "the controller")
        addr = json.loads(info.read_text())["addr"]
        for i, a in enumerate(hosts.addrs):
            agent = _tg("agent", "--controller", addr, "--token-file", run_dir / "token",
                        "--node-id", f"h{i}", "--advertise-addr", a, "--run-dir", run_dir)  # fmt: skip
            procs.append(
                subprocess.Popen(
                    hosts.cmd(i, agent),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    cwd=ROOT,
                )  # fmt: skip
            )

        def rank1_host() -> int | None:
            st = json.loads(subprocess.run(
                _tg("status", "--run-dir", run_dir, "--json"), capture_output=True, text=True,
                timeout=30, check=True).stdout)  # fmt: skip
            nodes = [n for n, r in st["assignment"].items() if r == 1]
            return int(nodes[0][1:]) if nodes else None

        victim = wait_until(rank1_host, 120, "node rank 1")
        wait_until(lambda: _reached(run_dir, args.kill_step), 600, f"step {args.kill_step}")
        hosts.kill_all(victim)
        for seg in Path("/dev/shm").glob(f"trainguard-{job}-h{victim}-*"):
            seg.unlink(missing_ok=True)  # a host that lost power lost its memory
        _, err = ctl.communicate(timeout=900)
        if ctl.returncode != 0:
            raise RuntimeError(f"the run failed:\n{err.decode()[-3000:]}")
        rep = json.loads(subprocess.run(
            _tg("report", "--run-dir", run_dir, "--json"), capture_output=True, text=True,
            timeout=60, check=True).stdout)  # fmt: skip
        recs = rep["recoveries"]
        if not recs:
            raise RuntimeError(f"the node's loss caused no recovery: {json.dumps(rep)[-2000:]}")
        rec = recs[0]  # the lost node's; a later one (a fault the load caused) is said
        return {
            "phases_s": rec["phases_s"],
            "restore_step": rec["restore_step"],
            "restore_tiers": rec["restore_tiers"],
            "steps_lost": rec["steps_lost"],
            "later_faults": [{k: r[k] for k in ("fault", "rank", "node")} for r in recs[1:]],
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        hosts.down()
        for seg in Path("/dev/shm").glob(f"trainguard-{job}-*"):
            if seg.is_dir():
                shutil.rmtree(seg, ignore_errors=True)
            else:
                seg.unlink(missing_ok=True)


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f} s"


def table_rows(result: dict[str, Any]) -> list[common.Row]:
    """The README's row: host loss to the first resumed step, peer replica against the
    durable tier, with the phases that differ."""
    rep, dur = result["replica"], result["durable"]
    pr, pd = rep["phases_s"], dur["phases_s"]
    model = model_text(result["model_args"])
    return [
        {
            "what": (
                "host loss → first resumed step (3 hosts in network namespaces, 1 standby; GPT "
                f"example, {model}, one rank a host; node rank 1's host SIGKILLed at step "
                f"{result['kill_step']}, durable every {result['durable_every']} steps)"
            ),
            "result": (
                f"peer replica {_s(pr.get('total'))} ({rep['steps_lost']} step(s) lost) vs "
                f"durable tier {_s(pd.get('total'))} ({dur['steps_lost']} lost); detect "
                f"{_s(pr.get('detect'))} / {_s(pd.get('detect'))}, replace "
                f"{_s(pr.get('replace'))} / {_s(pd.get('replace'))}, rendezvous "
                f"{_s(pr.get('rendezvous'))} / {_s(pd.get('rendezvous'))}, load "
                f"{_s(pr.get('load_checkpoint'))} / {_s(pd.get('load_checkpoint'))}"
            ),
            "target": "—",
        }
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--kill-step", type=int, default=25)
    p.add_argument("--durable-every", type=int, default=10)
    p.add_argument(
        "model_args", nargs="*", help="extra example flags after --, e.g. -- --n-embd 384"
    )
    common.add_common(p, smoke="the tiny model, 40 steps, the kill at step 20 (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.kill_step, args.durable_every = 40, 20, 10
        args.model_args = [*SMALL, *args.model_args]
    if not 1 <= args.kill_step < args.steps or args.durable_every < 1:
        p.error("--kill-step within the run (before its last step), --durable-every >= 1")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise SystemExit("node_recovery.py needs root and iproute2's ip (network namespaces)")
    tmp = Path(tempfile.mkdtemp(prefix="tg-noderec-"))
    try:
        r = {
            "steps": args.steps,
            "kill_step": args.kill_step,
            "durable_every": args.durable_every,
            "model_args": args.model_args,
            "replica": one_run(tmp, True, args),
            "durable": one_run(tmp, False, args),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    common.finish("node_recovery", args, r, argv)
    if args.json:
        return 0
    print(f"{'phase (s)':22s} {'peer replica':>14s} {'durable tier':>14s}")
    for name in RECOVERY_PHASES:
        a, b = r["replica"]["phases_s"].get(name), r["durable"]["phases_s"].get(name)
        fa = "-" if a is None else f"{a:.3f}"
        fb = "-" if b is None else f"{b:.3f}"
        print(f"{name:22s} {fa:>14s} {fb:>14s}")
    for key in ("restore_step", "steps_lost", "restore_tiers"):
        print(f"{key:22s} {str(r['replica'][key]):>14s} {str(r['durable'][key]):>14s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
