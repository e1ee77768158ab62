"""The live status line of ``trainguard run``: phase, generation, step and steps/s, loss,
tokens/s, the newest checkpoint in memory and on disk, and goodput so far.

On a terminal it is redrawn in place at the bottom (each log or worker line clears it first
and it is drawn again after); when the stream is not a terminal (batch logs) it is printed
as a plain line every ``every_s`` seconds, when it changed.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from trainguard.controller.server import Controller

CLEAR = "\r\x1b[2K"  # to column 0, erase the line


class StatusLine:
    def __init__(self, stream: IO[str] = sys.stderr, every_s: float = 30.0) -> None:
        self.stream, self.every_s = stream, every_s
        self.live = stream.isatty()
        self._last = 0.0
        self._text = ""

    @property
    def prefix(self) -> str:
        """What other output written to the terminal should start its lines with."""
        return CLEAR if self.live else ""

    def show(self, text: str) -> None:
        if self.live:
            cols = shutil.get_terminal_size((120, 24)).columns
            self.stream.write(CLEAR + text[: max(10, cols - 1)])
            self.stream.flush()
        elif text != self._text and time.monotonic() - self._last >= self.every_s:
            self.stream.write(text + "\n")
            self.stream.flush()
            self._last = time.monotonic()
        self._text = text

    def close(self) -> None:
        if self.live:
            self.stream.write(CLEAR)
            self.stream.flush()


def job_line(ctl: Controller) -> str:
    """One line about the job, from the controller's state and the monitor's figures."""
    s, fig = ctl.state, ctl.monitor.figures
    parts = [s.phase.value.lower() + (f" gen {s.generation}" if s.generation >= 0 else "")]
    if s.restarts:
        parts[0] += f" restarts {s.restarts}"
    if fig.newest >= 0:
        busy = sum(fig.recent)
        rate = f" ({len(fig.recent) / busy:.1f} steps/s)" if busy > 0 else ""
        parts.append(f"step {fig.newest}{rate}")
    if fig.loss is not None:
        parts.append(f"loss {fig.loss:.4g}")
    if fig.tokens_per_s:
        parts.append(f"{fig.tokens_per_s:,.0f} tok/s")
    mem = max((st for o in ctl.obs.values() for pts in o.memory.values() for st, _ in pts),
              default=None)  # fmt: skip
    ckpt = [f"memory {mem}"] if mem is not None else []
    if fig.durable_step is not None:
        ckpt.append(f"disk {fig.durable_step}")
    if "archive" in fig.tier_bytes:
        ckpt.append("archive")
    if ckpt:
        parts.append("ckpt " + ", ".join(ckpt))
    wall = time.time() - fig.started
    if fig.newest >= 0 and wall > 0:
        parts.append(f"goodput {min(1.0, fig.productive_s / wall):.0%}")
    return "trainguard │ " + " │ ".join(parts)
