"""The run dir's small files are written whole or not at all (a kill mid-write of the
controller leaves the old file or the new one, never a torn or empty one)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import stat
from pathlib import Path

from trainguard.cli.run import controller_info, read_or_create_token


def _make(path: str, q: mp.Queue) -> None:  # type: ignore[type-arg]
    q.put(read_or_create_token(Path(path)))


def test_a_token_is_made_once_whole_and_private_even_by_racing_processes(tmp_path: Path) -> None:
    path = tmp_path / "token"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_make, args=(str(path), q)) for _ in range(4)]
    for p in procs:
        p.start()
    got = {q.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(timeout=60)
    assert len(got) == 1 and got == {path.read_text()}  # one token, the file's
    assert len(bytes.fromhex(path.read_text())) == 16
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_or_create_token(path) == path.read_text()
    assert sorted(os.listdir(tmp_path)) == ["token"]  # no temp file left


def test_controller_json_is_replaced_not_rewritten_in_place(tmp_path: Path) -> None:
    controller_info(tmp_path, "127.0.0.1", 1234)
    before = (tmp_path / "controller.json").stat().st_ino
    controller_info(tmp_path, "127.0.0.1", 4321)
    after = tmp_path / "controller.json"
    assert after.stat().st_ino != before  # a new file renamed over the old: never torn
    assert json.loads(after.read_text()) == {"addr": "127.0.0.1:4321", "pid": os.getpid()}
    assert sorted(os.listdir(tmp_path)) == ["controller.json"]
