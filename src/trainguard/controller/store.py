"""The controller's durable store: SQLite (``RUN_DIR/job.sqlite``) plus ``events.jsonl``.

Tables: ``kv`` (job config and state as JSON), ``events`` (every structured event),
``steps`` (per-rank step records, with their timed sections as JSON). Writes come from the controller's event loop
thread only; readers (``trainguard events|report``) open their own connection.

The store's format is its SQLite ``user_version`` (``FORMAT``): a store of an older format is
brought up to this one when the controller opens it (0: written before formats were numbered;
1: before per-step sections); one of a newer format, written by a newer trainguard, is refused
with a one-line error (ValueError) before anything in it is changed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from trainguard.protocol import StepRecord, clock

SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, kind TEXT NOT NULL,
  generation INTEGER, node TEXT, rank INTEGER, step INTEGER, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
  generation INTEGER NOT NULL, rank INTEGER NOT NULL, step INTEGER NOT NULL,
  t_end REAL NOT NULL, duration_s REAL NOT NULL, loss REAL, tokens INTEGER, sections TEXT,
  PRIMARY KEY (generation, rank, step));
"""
STEP_ROWS_BUFFERED = 50_000  # step rows held before flush_steps is called
FORMAT = 2  # the store format this version writes (SQLite user_version)


def check_format(db: sqlite3.Connection, path: Path) -> int:
    """The format of the store ``db`` (its user_version). Raises ValueError naming the fix when
    a newer trainguard wrote it (this version would misread or damage it)."""
    found = int(db.execute("PRAGMA user_version").fetchone()[0])
    if found > FORMAT:
        raise ValueError(
            f"{path} was written by a newer trainguard (store format {found}, this version "
            f"reads up to {FORMAT}); use that version, or pass another --run-dir"
        )
    return found


def end_torn_line(path: Path) -> None:
    """End the last line of ``path`` when a writer killed mid-line left it torn: the next
    event starts a line of its own instead of being glued to the fragment (both were lost)."""
    with contextlib.suppress(FileNotFoundError), open(path, "rb+") as f:
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


class Store:
    """Owns the job's SQLite file and JSONL event log. Not thread-safe: one writer thread."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        path = run_dir / "job.sqlite"
        self.db = sqlite3.connect(path, timeout=10.0, isolation_level=None)
        try:
            check_format(self.db, path)
        except ValueError:
            self.db.close()
            raise
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        cols = {r[1] for r in self.db.execute("PRAGMA table_info(steps)")}
        if "sections" not in cols:  # a store written before section timing existed
            self.db.execute("ALTER TABLE steps ADD COLUMN sections TEXT")
        self.db.execute(f"PRAGMA user_version = {FORMAT}")
        end_torn_line(run_dir / "events.jsonl")
        self._jsonl = open(run_dir / "events.jsonl", "a", buffering=1)  # noqa: SIM115
        self._step_rows: list[tuple[Any, ...]] = []  # add_steps's, until flush_steps

    def record(self, kind: str, data: dict[str, Any], *, ts: float | None = None) -> dict[str, Any]:
        """Append one event to both logs; returns it as written."""
        ts = clock.wall() if ts is None else ts
        row = {"ts": ts, "kind": kind, **data}
        self.db.execute(
            "INSERT INTO events (ts, kind, generation, node, rank, step, data) VALUES (?,?,?,?,?,?,?)",
            (
                ts,
                kind,
                data.get("generation"),
                data.get("node"),
                data.get("rank"),
                data.get("step"),
                json.dumps(data, default=str),
            ),
        )
        self._jsonl.write(json.dumps(row, default=str) + "\n")
        return row

    def add_steps(self, generation: int, rank: int, items: list[StepRecord]) -> None:
        """Buffer one rank's step records; ``flush_steps`` writes them (the controller calls
        it at the end of each report and relay uplink it takes: one transaction for all the
        step records of an uplink, not one per rank — at 16,384 nodes, 131,072 ranks report
        each heartbeat). Past ``STEP_ROWS_BUFFERED`` rows they are written at once."""
        self._step_rows += [
            (generation, rank, it.step, it.t_end, it.duration_s, it.loss, it.tokens,
             json.dumps({**it.sections, "t_coll": it.t_coll, "gap": it.gap}))
            for it in items
        ]  # fmt: skip
        if len(self._step_rows) >= STEP_ROWS_BUFFERED:
            self.flush_steps()

    def flush_steps(self) -> None:
        """Write the buffered step records in one transaction."""
        if not self._step_rows:
            return
        rows, self._step_rows = self._step_rows, []
        with self.db:  # BEGIN … COMMIT (ROLLBACK on an error: none of them, not a part)
            self.db.execute("BEGIN")
            self.db.executemany("INSERT OR REPLACE INTO steps VALUES (?,?,?,?,?,?,?,?)", rows)

    def put(self, key: str, value: Any) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, json.dumps(value, default=str))
        )

    def put_text(self, key: str, text: str) -> None:
        """``put`` of a value already encoded as JSON ``text`` (no second encoding)."""
        self.db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, text))

    def get(self, key: str) -> Any:
        row = self.db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def close(self) -> None:
        self.flush_steps()
        self._jsonl.close()
        self.db.close()


def open_readonly(run_dir: Path) -> sqlite3.Connection:
    """Open a run's store for reading. Raises FileNotFoundError naming the fix."""
    path = run_dir / "job.sqlite"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no trainguard store here; pass the --run-dir of a job")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
    try:
        check_format(db, path)
    except ValueError:
        db.close()
        raise
    return db


def read_kv(db: sqlite3.Connection, key: str) -> Any:
    row = db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
    return None if row is None else json.loads(row[0])


def read_events(db: sqlite3.Connection) -> list[dict[str, Any]]:
    rows = db.execute("SELECT ts, kind, data FROM events ORDER BY id").fetchall()
    return [{"ts": ts, "kind": kind, **json.loads(data)} for ts, kind, data in rows]
