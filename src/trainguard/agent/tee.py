"""Worker output on the launcher's console, as torchrun shows it: each line of the chosen
ranks' logs, prefixed ``[rankN]:``, as it is written (default rank 0 only; ``--tee`` all;
``--local-ranks-filter 0,3`` those; ``none`` nothing). The logs stay the record; this only
follows them (a generation's files are ``rank{R}.gen{G}.log`` in the log directory)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

_NAME = re.compile(r"rank(\d+)\.gen(\d+)\.log$")
MAX_READ = 1 << 20  # per file per poll: a flood of output cannot stall the launcher's loop


def parse_ranks(tee: str | None, filt: str | None) -> set[int] | None:
    """The ranks to show (None = every rank). Raises ValueError naming the form."""
    if filt is not None:
        if filt.strip().lower() == "none":
            return set()
        try:
            return {int(x) for x in filt.split(",") if x.strip()}
        except ValueError:
            raise ValueError(
                f"--local-ranks-filter {filt}: give ranks like 0,3 (or none)"
            ) from None
    if tee is not None:
        if tee not in ("0", "1", "2", "3"):
            raise ValueError(f"--tee {tee}: use torchrun's 0-3 (0 = none, 1-3 = show output)")
        return set() if tee == "0" else None
    return {0}


class Tee:
    """Follow ``log_dir``'s rank logs; ``poll()`` prints what is new (complete lines).
    ``only``: follow just the files it accepts (an agent: the logs of the workers it started,
    when the log directory is shared with other hosts)."""

    def __init__(
        self,
        log_dir: Path,
        ranks: set[int] | None,
        out: IO[str] = sys.stdout,
        prefix: str = "",
        only: Callable[[Path], bool] | None = None,
    ) -> None:
        self.log_dir, self.ranks, self.out, self.only = log_dir, ranks, out, only
        self.prefix = prefix  # e.g. what clears the live status line first
        self._pos: dict[Path, int] = {}  # what an earlier run of this run dir wrote is not new
        for path in log_dir.glob("rank*.gen*.log") if log_dir.is_dir() else []:
            self._pos[path] = path.stat().st_size
        self._partial: dict[Path, bytes] = {}

    def rewind(self, paths: set[Path]) -> None:
        """Follow ``paths`` from their first byte (files of this run found already there)."""
        for path in paths:
            self._pos.pop(path, None)

    def poll(self, *, final: bool = False) -> None:
        if self.ranks is not None and not self.ranks:
            return
        try:
            paths = sorted(self.log_dir.glob("rank*.gen*.log"), key=_order)
        except OSError:
            return
        for path in paths:
            m = _NAME.search(path.name)
            if m is None or (self.ranks is not None and int(m.group(1)) not in self.ranks):
                continue
            if self.only is not None and not self.only(path):
                continue
            self._follow(path, int(m.group(1)), final)
        self.out.flush()

    def _follow(self, path: Path, rank: int, final: bool) -> None:
        try:
            with open(path, "rb") as f:
                f.seek(self._pos.get(path, 0))
                data = f.read(MAX_READ)
        except OSError:
            return
        self._pos[path] = self._pos.get(path, 0) + len(data)
        buf = self._partial.pop(path, b"") + data
        lines = buf.split(b"\n")
        rest = lines.pop()
        if rest and final:
            lines.append(rest)
        elif rest:
            self._partial[path] = rest
        for line in lines:
            self.out.write(f"{self.prefix}[rank{rank}]:{line.decode(errors='replace')}\n")


def _order(p: Path) -> tuple[int, int]:
    m = _NAME.search(p.name)
    return (int(m.group(2)), int(m.group(1))) if m else (0, 0)
