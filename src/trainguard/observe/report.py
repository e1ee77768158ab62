"""``trainguard report`` and ``trainguard events``: where a job's time went.

Goodput here is the effective training time ratio (ETTR): the summed duration of
the steps that count (for each step, rank 0's run of it in the newest generation)
divided by the job's wall time from start to end, less the pre-flight checks that ran
before the first generation (reported on their own line: screening nodes is not lost
training). Work redone after a restart and all recovery time count against it. A script that
reports no steps (it never calls trainguard's runtime) has no goodput: the report says so, and
lists what it could not see.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from trainguard.controller.api import RECOVERY_PHASES
from trainguard.controller.store import open_readonly, read_events, read_kv
from trainguard.faults.inject import InjectSpec
from trainguard.observe import goodput, local
from trainguard.observe.console import console, plural, styled
from trainguard.observe.processes import processes

PHASES = RECOVERY_PHASES
ONE_SHOT = ("kill", "exit", "hang", "node-down", "hang-collective")  # drills that report firing


def _archive(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The cold tier's account: uploads, bytes sent against the steps' bytes (incremental
    and compressed), the newest step with the required copies, restores, failures."""
    up = [e for e in events if e["kind"] == "archive_uploaded"]
    return {
        "uploads": len(up),
        "step_bytes": sum(int(e.get("bytes", 0)) for e in up),
        "sent_bytes": sum(int(e.get("stored_bytes", 0)) for e in up),
        "newest_durable": max(
            (e["step"] for e in events if e["kind"] == "archive_durable"), default=None
        ),
        "restored": [e["step"] for e in events if e["kind"] == "archive_restored"],
        "failures": sum(1 for e in events if e["kind"] == "archive_failed"),
    }


def _sdc(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each silent data corruption: where it was seen, the culprits, the last agreeing step,
    the point the next generation restored and the steps it recomputed."""
    out = []
    for i, e in enumerate(events):
        if e["kind"] != "sdc_detected":
            continue
        nxt = next((x for x in events[i:] if x["kind"] == "generation_started"), None)
        back = nxt["restore_step"] if nxt is not None else None
        settled = next(
            (
                x
                for x in events[i:]
                if x["kind"] in ("sdc_localized", "sdc_unlocalized")
                and (x["step"], x["generation"]) == (e["step"], e["generation"])
            ),
            None,
        )  # a disagreement no majority decided, settled by recomputation (controller/recompute.py)
        out.append(
            {
                "generation": e["generation"],
                "step": e["step"],
                "signal": e.get("signal", "fingerprints"),
                "detail": e.get("detail"),
                "culprits": e["culprits"],
                "nodes": e["nodes"],
                "last_agreed": (e.get("last_agreed") or [None])[0],
                "rollback_to": back,
                "steps_recomputed": e["step"] - (back or 0) if nxt is not None else None,
                "held_out": e.get("held_out"),
                "recomputation": None
                if settled is None
                else {k: settled.get(k) for k in ("nodes", "how", "action", "recomputed_on")},
            }
        )
    return out


def _load(
    run_dir: Path,
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any], list[Any], int]:
    """The store's job state, events, config and rank 0's counted steps (step, seconds,
    generation), the events and steps of the run dir's newest run only; and its runs."""
    db = open_readonly(run_dir)
    try:
        state = read_kv(db, "state") or {}
        events = read_events(db)
        cfg = read_kv(db, "config") or {}
        rank0 = db.execute(
            "SELECT generation, step, duration_s, sections FROM steps WHERE rank = 0 ORDER BY t_end"
        ).fetchall()
    finally:
        db.close()
    # A run dir run again (a re-run after a crash or a stop): the report is of its newest run.
    starts = [i for i, e in enumerate(events) if e["kind"] == "job_started"]
    runs = len(starts)
    if starts:
        events = events[starts[-1] :]
        first = next((e["generation"] for e in events if e["kind"] == "generation_started"), None)
        if first is not None:
            rank0 = [r for r in rank0 if r[0] >= first]
    return state, events, cfg, rank0, runs


def _drills(
    state: dict[str, Any], cfg: dict[str, Any], rows: list[Any], first_gen: float | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """The one-shot drills and whether each fired; what the report could not see."""
    fired = set(state.get("fired", []))
    drills = [  # the one-shot drills (each says when it fired); slow/data/pre-flight ones act throughout
        {"inject": (spec := InjectSpec.from_json(d)).describe(), "fired": spec.id in fired}
        for d in cfg.get("injects", [])
        if d.get("kind") in ONE_SHOT
    ]
    unseen = []
    if not rows and first_gen is not None:
        unseen.append(
            "steps: the script reported none (it calls neither trainguard.init nor a "
            "Checkpointer, or it failed before its first step), so there is no step progress, "
            "goodput or step-based drill; hangs were judged from process state and CPU time only"
        )
    for d in drills:
        if not d["fired"] and ":step=" in d["inject"] and not rows:
            unseen.append(f"drill {d['inject']} never fired: the script reports no steps "
                          f"(use after=SECONDS)")  # fmt: skip
    return drills, unseen


def _faults(state: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every fault, and the recoveries among their attempts."""
    attempts = list(state.get("recoveries", []))
    if state.get("recovery"):
        attempts.append(state["recovery"])
    # Every fault is listed; a recovery is one that reached its first resumed step.
    # (Without step reports: one whose new generation ran to the job's successful end.)
    recoveries = [
        r
        for r in attempts
        if r.get("t_first_step") is not None
        or (state.get("phase") == "SUCCEEDED" and r.get("to_generation") == state.get("generation"))
    ]
    faults = [
        {k: r["fault"][k] for k in ("cause", "rank", "node_id", "step", "generation", "message")}
        for r in attempts
    ]
    return faults, recoveries


def _hangs(events: list[dict[str, Any]], faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each hang of a known rank, with that rank's py-spy stack."""
    stacks: dict[tuple[int, int], str] = {}  # (generation, rank) → py-spy stack
    for e in events:
        if e["kind"] in ("stacks", "hang_suspected"):
            for r, text in (e.get("stacks") or {}).items():
                stacks.setdefault((int(e.get("generation") or 0), int(r)), text)
    return [
        {
            "generation": f["generation"],
            "rank": f["rank"],
            "node": f["node_id"],
            "step": f["step"],
            "message": f["message"],
            "stack": stacks.get((f["generation"], f["rank"]), "(no stack captured)"),
        }
        for f in faults
        if f["cause"] == "hang" and f["rank"] is not None
    ]


def _left_out(events: list[dict[str, Any]], state: dict[str, Any]) -> dict[str, str]:
    """The nodes left faulty or retired, each with why."""
    pools = state.get("pools", {})
    why: dict[str, str] = {}
    for e in events:
        if e["kind"] == "pool_changed" and e.get("to") in ("faulty", "retired"):
            why[e["node"]] = e.get("reason", "")
    return {n: why.get(n, "") for n, p in sorted(pools.items()) if p in ("faulty", "retired")}


def _preflight(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pre-flight run: its nodes, the failed and the inconclusive ones, its seconds."""
    return [
        {
            "run": e["run"],
            "level": e["level"],
            "reason": e["reason"],
            "nodes": e["nodes"],
            "seconds": e.get("stage_s", {}).get("total"),
            "failed": {
                n: v["problems"]
                for n, v in e["verdicts"].items()
                if not v["ok"] and not v.get("inconclusive")
            },
            "inconclusive": {
                n: v["problems"] for n, v in e["verdicts"].items() if v.get("inconclusive")
            },
        }
        for e in events
        if e["kind"] == "preflight_finished"
    ]


def _recoveries(
    recoveries: list[dict[str, Any]], events: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each recovery: its fault, mode, generations, restore step and tiers, steps lost, the
    processes kept and new, phases."""
    return [
        {
            "mode": r.get("mode", "restart"),
            "mode_reason": r.get("mode_reason", ""),
            **processes(r, events),
            "fault": r["fault"]["cause"],
            "rank": r["fault"]["rank"],
            "node": r["fault"]["node_id"],
            "from_generation": r["from_generation"],
            "to_generation": r["to_generation"],
            "restore_step": r["restore_step"],
            "steps_lost": r["steps_lost"],
            "restore_tiers": r.get("restore_tiers", {}),
            "replaced": r.get("replaced", {}),
            "phases_s": r["durations_s"],
        }
        for r in recoveries
    ]


def build_report(run_dir: Path) -> dict[str, Any]:
    """The report as a dict (the ``--json`` output). Raises FileNotFoundError for a non-run dir."""
    state, events, cfg, rank0, runs = _load(run_dir)
    t0, _ = goodput.wall_span(events)
    # (step, seconds, generation) of each step counted once; the breakdown the job page shows
    rows = [(step, dur, gen) for gen, step, dur, _ in goodput.counted(rank0)]
    spent = goodput.breakdown(rank0, events, state)
    first_gen = next((e["ts"] for e in events if e["kind"] == "generation_started"), None)
    drills, unseen = _drills(state, cfg, rows, first_gen)
    faults, recoveries = _faults(state)
    alerts = [
        {k: v for k, v in e.items() if k != "ts"}
        for e in events
        if e["kind"]
        in ("straggler", "loss_spike", "loss_nonfinite", "grad_norm_spike", "throughput_drop")
    ]
    is_check = any(e["kind"] == "check_started" for e in events) and t0 is None
    return {
        "run_dir": str(run_dir),
        "kind": "check" if is_check else "job",
        "incarnation": int(state.get("incarnation", 0)),
        "earlier_runs": max(0, runs - 1),
        "phase": state.get("phase"),
        "reason": state.get("reason", ""),
        "generations": sum(e["kind"] == "generation_started" for e in events),
        "steps_completed": [r[0] for r in rows],
        "last_step": rows[-1][0] if rows else None,
        "wall_time_s": spent["wall_s"],
        "productive_step_time_s": spent["productive_s"],
        "preflight_s": spent["preflight_s"],
        "goodput": spent["ratio"],
        "drills": drills,
        "unseen": unseen,
        "faults": faults,
        "preflight": _preflight(events),
        "left_out": _left_out(events, state),
        "hangs": _hangs(events, faults),
        "snapshots_skipped": sum(1 for e in events if e["kind"] == "ckpt_skipped"),
        "max_skipped_in_a_row": max(
            (int(e.get("skipped_in_a_row", 1)) for e in events if e["kind"] == "ckpt_skipped"),
            default=0,
        ),
        "planned_stops": [
            {k: e.get(k) for k in ("generation", "why", "last_step", "saved_step", "steps_lost")}
            for e in events
            if e["kind"] == "planned_stop"
        ],
        "alerts": alerts,
        "archive": _archive(events),
        "sdc": _sdc(events),
        "at_risk": [
            {k: e.get(k) for k in ("node", "reason", "action")}
            for e in events
            if e["kind"] == "node_at_risk"
        ],
        "recoveries": _recoveries(recoveries, events),
        "local": {
            "recoveries": local.local_recoveries(events),
            "reduced_width": local.reduced_width(events, rows[-1][0] if rows else None),
            "fallbacks": local.fallbacks(events),
        },
    }


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def print_report(run_dir: Path, *, as_json: bool) -> int:
    """Print the report of ``run_dir`` (text, or JSON with ``as_json``); returns 0."""
    rep = build_report(run_dir)
    if as_json:
        print(json.dumps(rep, indent=2))
        return 0
    show_report(rep)
    return 0


def show_report(rep: dict[str, Any]) -> None:
    """Print ``build_report``'s report as text."""
    con = console()
    con.print(styled(("trainguard report", "bold"), f" {rep['run_dir']}"))
    if rep["kind"] == "check":
        con.print(f"pre-flight check (trainguard check): {rep['reason']}")
        _print_preflight(con, rep)
        return
    _print_job(con, rep)
    _print_sdc(con, rep["sdc"])
    for r in rep["at_risk"]:
        con.print(styled(("at risk: ", "yellow"), f"{r['node']}: {r['reason']} ({r['action']})"))
    for line in rep["unseen"]:
        con.print(styled(("not seen: ", "yellow"), line))
    _print_preflight(con, rep)
    _print_faults(con, rep)
    if rep["alerts"]:
        _print_alerts(con, rep["alerts"])
    if rep["recoveries"]:  # none: no empty table (a fault-free or a local-recovery job)
        _print_recoveries(con, rep["recoveries"])
    _print_modes(con, rep["recoveries"])
    _print_local(con, rep["local"])


def _or_dash(v: object) -> str:
    return "—" if v is None else str(v)


def _print_local(con: Console, rep: dict[str, Any]) -> None:
    """Local recovery: a line per group restart, the steps at reduced width, the fallbacks."""
    for r in rep["recoveries"]:
        heal = r["heal"]
        back = (
            f"back in {r['rejoined_s']:.2f} s with group {heal['source_group']}'s state after "
            f"step {heal['step']} ({heal['bytes']:,} bytes in {heal['seconds']:.3f} s)"
            if heal is not None and r["rejoined_s"] is not None
            else "not back"
        )
        con.print(f"local recovery: replica group {r['group']} ({r['reason']}): {back}")
    steps = rep["reduced_width"]
    if steps:
        batches = sum(len(s["missing_batches"]) for s in steps)
        con.print(
            styled(("reduced width: ", "yellow"),
                   f"{len(steps)} step(s) ({steps[0]['step']}–{steps[-1]['step']}) trained "
                   f"without some groups; {batches} batch(es) not trained (report --json: "
                   "local.reduced_width)")
        )  # fmt: skip
    for f in rep["fallbacks"]:
        con.print(f"global recovery instead: replica group {f['group']} ({f['reason']}): "
                  f"{f['because']}")  # fmt: skip


def _pids(procs: dict[str, int]) -> str:
    return ", ".join(
        f"{r} (pid {pid})" for r, pid in sorted(procs.items(), key=lambda x: int(x[0]))
    )


def _print_modes(con: Console, recoveries: list[dict[str, Any]]) -> None:
    """Per recovery, how it recovered: in process (the ranks kept, with their pids, and the new
    ones) or a restart of every rank, and why; each kept rank that was killed instead."""
    for r in recoveries:
        gen = f"{r['from_generation']}→{r['to_generation']}"
        if r.get("mode") == "inprocess":
            con.print(f"{gen} in process: kept rank(s) {_pids(r.get('kept') or {}) or '—'}; "
                      f"new: {_pids(r.get('new') or {}) or '—'}")  # fmt: skip
        else:
            con.print(f"{gen} restart of every rank: {r.get('mode_reason') or 'restart path'}")
        for e in r.get("escalated") or []:
            con.print(styled(f"{gen} escalated rank {e['rank']} to a restart: ",
                             (str(e["reason"]), "yellow")))  # fmt: skip


def _print_job(con: Console, rep: dict[str, Any]) -> None:
    """The job's lines: phase, runs, steps and goodput, back-pressure, planned stops, the
    cold tier, the drills."""
    con.print(f"job: {rep['phase']}  {rep['reason']}")
    if rep["earlier_runs"]:
        con.print(
            f"run {rep['incarnation'] + 1} of this run dir: the report covers this run; "
            f"{rep['earlier_runs']} earlier run(s) are in its events (trainguard events)"
        )
    goodput = "unknown (no steps reported)" if rep["goodput"] is None else f"{rep['goodput']:.1%}"
    con.print(
        f"steps completed: {len(rep['steps_completed'])} (last {_or_dash(rep['last_step'])}) "
        f"in {rep['generations']} "
        f"generation(s); wall time {rep['wall_time_s']:.1f}s (pre-flight {rep['preflight_s']:.1f}s, "
        f"not counted); productive step time {rep['productive_step_time_s']:.1f}s; "
        f"goodput (ETTR) {goodput}"
    )
    if rep["snapshots_skipped"]:
        con.print(
            styled(("back-pressure: ", "yellow"),
                   f"{rep['snapshots_skipped']} snapshot(s) skipped, at most "
                   f"{rep['max_skipped_in_a_row']} in a row (every slot still being persisted: "
                   "the disk was slower than the steps)")
        )  # fmt: skip
    for p in rep["planned_stops"]:
        con.print(
            f"planned stop of generation {p['generation']} ({p['why']}): last step "
            f"{p['last_step']}, saved step {p['saved_step']}, steps lost {p['steps_lost']}"
        )
    arc = rep["archive"]
    if arc["uploads"] or arc["failures"] or arc["restored"]:
        con.print(
            f"cold tier: {arc['uploads']} upload(s), {arc['sent_bytes'] / 1e6:.1f} MB sent for "
            f"{arc['step_bytes'] / 1e6:.1f} MB of steps; newest archived step "
            f"{arc['newest_durable']}; restored from it: {arc['restored'] or 'none'}; "
            f"failures: {arc['failures']}"
        )
    for d in rep["drills"]:
        con.print(f"drill {d['inject']}: {'fired' if d['fired'] else 'did not fire'}")


def _print_sdc(con: Console, sdc: list[dict[str, Any]]) -> None:
    """One line per silent data corruption: the signal, the culprits, the rollback."""
    for x in sdc:
        rec = x.get("recomputation")
        who = (
            f"rank(s) {x['culprits']} on {x['nodes']}" if x["culprits"]
            else f"on {x['nodes'][0]}" if x["nodes"]
            else f"named by recomputation: {', '.join(rec['nodes'])} ({rec['how']}; "
                 f"{rec['action']})" if rec and rec["nodes"]
            else "not localized"
        )  # fmt: skip
        seen = {"fingerprints": "replica fingerprints", "gemm_probe": "GEMM probe",
                "grad_norm": "gradient norm"}.get(x["signal"], x["signal"])  # fmt: skip
        last = f"last agreeing step {x['last_agreed']}, " if x["last_agreed"] is not None else ""
        con.print(
            styled(("silent data corruption: ", "red"),
                   f"generation {x['generation']}, detected at step {x['step']} by {seen} "
                   f"({who}); {last}rolled back to {x['rollback_to']}, "
                   f"{x['steps_recomputed']} step(s) recomputed")
        )  # fmt: skip


def _print_faults(con: Console, rep: dict[str, Any]) -> None:
    """The faults' table, then each hang with the stack of the rank that held the others."""
    if not rep["faults"]:  # no empty table; a replica group's own restarts are listed below
        local = len(rep["local"]["recoveries"])
        con.print(
            "faults: none"
            if not local
            else f"faults: none that stopped the job ({plural(local, 'replica group restart')} "
            "below)"
        )
    faults = Table(title=f"faults: {len(rep['faults'])}")
    for col in ("gen", "cause", "rank", "node", "step", "message"):
        faults.add_column(col)
    for f in rep["faults"]:
        faults.add_row(
            str(f["generation"]),
            f["cause"],
            str(f["rank"]),
            str(f["node_id"]),
            str(f["step"]),
            next(iter((f["message"] or "").splitlines()), "")[:100],
        )
    if rep["faults"]:
        con.print(faults)
    for h in rep["hangs"]:
        con.print(f"hang in generation {h['generation']}: {h['message']}")
        con.print(f"  stack of rank {h['rank']} ({str(h['node'])}), the rank that held the others:")
        for line in condensed_stack(h["stack"]).splitlines()[:40]:
            con.print(f"    {line}", markup=False, highlight=False)


_PY_FRAME = re.compile(r"\([^()]*:\d+\)$")  # py-spy's "func (file.py:123)"


def condensed_stack(text: str, native: int = 3) -> str:
    """A py-spy ``--native`` dump with each thread's native frames cut to the ``native``
    innermost ones before its first Python frame (where the thread waits: a mutex, the GIL, a
    socket) and none after; Python frames and the thread lines kept whole."""
    out: list[str] = []
    seen_native = 0
    seen_python = False
    for line in text.splitlines():
        frame = line.startswith(" ")
        if not frame:
            seen_native, seen_python = 0, False
        elif _PY_FRAME.search(line.strip()):
            seen_python = True
        else:
            seen_native += 1
            if seen_python or seen_native > native:
                continue
        out.append(line)
    return "\n".join(out)


def _print_alerts(con: Console, alerts: list[dict[str, Any]]) -> None:
    al = Table(title=f"alerts: {len(alerts)}")
    for col in ("kind", "gen", "step", "rank", "node", "detail"):
        al.add_column(col)
    for a in alerts:
        step = a.get("step", a.get("steps"))
        detail = {
            k: v
            for k, v in a.items()
            if k not in ("kind", "generation", "step", "steps", "rank", "node")
        }
        al.add_row(
            a["kind"], str(a.get("generation", "")), str(step if step is not None else ""),
            str(a.get("rank", "")), str(a.get("node", "")), json.dumps(detail)[:90],
        )  # fmt: skip
    con.print(al)


def _tiers_cell(tiers: dict[str, int]) -> str:
    """Ranks restored per tier, fastest first: ``mem 2/replica 2/disk 0`` (memory and disk
    always, any other tier when it served a rank); "—" when the recovery restored nothing."""
    if not tiers:
        return "—"
    short = {"memory": "mem", "durable": "disk"}
    order = ["memory", *(k for k in tiers if k not in ("memory", "durable")), "durable"]
    return "/".join(
        f"{short.get(k, k)} {tiers.get(k, 0)}"
        for k in order
        if k in ("memory", "durable") or tiers.get(k)
    )


RECOVERY_LEGEND = (
    "kept/new: worker processes kept / started (in-process recovery); restore: the step "
    "resumed from; from: ranks restored from each tier (mem: their node's shared memory, "
    "replica: a peer node's copy, disk: the durable tier, archive: object storage); lost: "
    "steps run again"
)


def _print_recoveries(con: Console, recoveries: list[dict[str, Any]]) -> None:
    """One row per recovery on a wide terminal; on a narrow one (a pipe, 80 columns) one
    column per recovery, the phases down the side, as many recoveries a table as fit."""
    title = f"recoveries: {len(recoveries)} (seconds per phase)"
    rows = []
    for r in recoveries:
        tiers = r.get("restore_tiers") or {}
        rows.append(
            (
                f"{r['from_generation']}→{r['to_generation']}",
                "in-proc" if r.get("mode") == "inprocess" else "restart",
                f"{len(r.get('kept') or {})}/{len(r.get('new') or {})}",
                str(r["restore_step"]),
                _tiers_cell(tiers),
                str(r["steps_lost"]),
                *(_fmt(r["phases_s"].get(p)) for p in PHASES),
            )
        )
    heads = ("gen", "mode", "kept/new", "restore", "from", "lost", *PHASES)
    if con.width >= 130 or not rows:
        rec = Table(title=title)
        for col in heads:
            rec.add_column(col, justify="right")
        for row in rows:
            rec.add_row(*row)
        con.print(rec)
        if rows:
            con.print(RECOVERY_LEGEND, style="dim")
        return
    per = max(1, (con.width - 20) // 16)  # recovery columns that fit beside the phase names
    for i in range(0, len(rows), per):
        part = rows[i : i + per]
        rec = Table(title=title if i == 0 else None)
        rec.add_column("")
        for row in part:
            rec.add_column(row[0], justify="right")
        for j, head in enumerate(heads[1:], start=1):
            rec.add_row(head, *(row[j] for row in part))
        con.print(rec)
    con.print(RECOVERY_LEGEND, style="dim")


def _print_preflight(con: Console, rep: dict[str, Any]) -> None:
    if rep["preflight"]:
        pre = Table(title=f"pre-flight runs: {len(rep['preflight'])}")
        for col in ("run", "level", "why", "nodes", "failed", "inconclusive", "seconds"):
            pre.add_column(col)
        for r in rep["preflight"]:
            pre.add_row(
                str(r["run"]), r["level"], r["reason"], ", ".join(r["nodes"]),
                ", ".join(r["failed"]) or "—", ", ".join(r.get("inconclusive", {})) or "—",
                _fmt(r["seconds"]),
            )  # fmt: skip
        con.print(pre)
    for node, reason in rep["left_out"].items():
        con.print(styled("left out: ", (node, "red"), f": {reason}"))


# Per-snapshot bookkeeping: hundreds per run; shown with --all or --kind.
ROUTINE = frozenset({"ckpt_staged", "replica_stored", "ckpt_part_durable", "ckpt_durable"})


def print_events(
    run_dir: Path, *, as_json: bool, kinds: list[str] | None = None, everything: bool = False
) -> int:
    """Print a run's events in time order: ``kinds`` keeps only those kinds; without
    ``everything`` the text listing counts the routine checkpoint events instead of listing
    them (JSON lists every event)."""
    db = open_readonly(run_dir)
    try:
        events = sorted(read_events(db), key=lambda e: e["ts"])
    finally:
        db.close()
    hidden = 0
    if kinds:
        events = [e for e in events if e["kind"] in kinds]
    elif not everything and not as_json:
        shown = [e for e in events if e["kind"] not in ROUTINE]
        hidden, events = len(events) - len(shown), shown
    if as_json:
        for e in events:
            print(json.dumps(e, default=str))
        return 0
    table = Table(title=f"events: {len(events)}")
    for col in ("time", "kind", "gen", "node", "rank", "detail"):
        table.add_column(col)
    t0 = events[0]["ts"] if events else 0.0
    for e in events:
        detail = {
            k: v for k, v in e.items() if k not in ("ts", "kind", "generation", "node", "rank")
        }
        table.add_row(
            f"+{e['ts'] - t0:.3f}",
            e["kind"],
            str(e.get("generation", "")),
            str(e.get("node", "")),
            str(e.get("rank", "")),
            json.dumps(detail, default=str)[:100],
        )
    console().print(table)
    if hidden:
        print(
            f"{hidden} routine checkpoint events not shown ({', '.join(sorted(ROUTINE))}); --all shows them"
        )
    return 0
