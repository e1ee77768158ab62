"""The incremental JSON-lines reader behind the tests' and chaos's event and metric polls."""

from __future__ import annotations

import json
from pathlib import Path

from trainguard.chaos.faults import events, metrics


def _append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_appended_lines_are_read_a_torn_line_waits_and_a_new_file_is_read_from_its_start(
    tmp_path: Path,
) -> None:
    assert events(tmp_path) == [] and metrics(tmp_path) == []
    log = tmp_path / "events.jsonl"
    _append(log, json.dumps({"kind": "a"}) + "\n" + '{"kind": "b"')  # b is being written
    assert [e["kind"] for e in events(tmp_path)] == ["a"]
    _append(log, "}\nnot json\n" + json.dumps({"kind": "c"}) + "\n")
    assert [e["kind"] for e in events(tmp_path)] == ["a", "b", "c"]
    got = events(tmp_path)
    got.append({"kind": "mine"})  # a caller's list is its own
    assert len(events(tmp_path)) == 3
    log.unlink()  # a re-created file (another inode) is read from its start
    _append(log, json.dumps({"kind": "d"}) + "\n")
    assert [e["kind"] for e in events(tmp_path)] == ["d"]
    with open(log, "w") as f:  # truncated in place: shorter than what was read
        f.write("")
    assert events(tmp_path) == []
    _append(log, json.dumps({"kind": "e"}) + "\n")
    assert [e["kind"] for e in events(tmp_path)] == ["e"]
    with open(log, "w") as f:  # rewritten in place, longer than before: other first bytes
        f.write(json.dumps({"kind": "f", "pad": "x" * 40}) + "\n")
    assert [e["kind"] for e in events(tmp_path)] == ["f"]
    m = tmp_path / "metrics.jsonl"
    _append(m, json.dumps({"step": 1, "loss": 2.5, "time": 7.0}) + "\n" + '{"step": 2}\n')
    assert metrics(tmp_path) == [(1, 2.5, 7.0)]  # a line without a loss is skipped
