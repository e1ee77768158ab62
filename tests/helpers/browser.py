"""Headless Chromium (Debian's ``chromium`` package) driven from tests: the DOM after the
page's scripts ran, and a screenshot. Every browser process is killed at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

TIMEOUT_S = 90.0


def chromium() -> str | None:
    """The Chromium binary, or None when it is not installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run(args: list[str], url: str) -> subprocess.CompletedProcess[str]:
    exe = chromium()
    assert exe is not None, "chromium is not installed (apt-get install chromium)"
    with tempfile.TemporaryDirectory(prefix="tg-chromium-") as profile:
        cmd = [
            exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--hide-scrollbars", f"--user-data-dir={profile}",
            "--window-size=1400,1250", "--virtual-time-budget=20000",
            "--enable-logging=stderr", "--v=0", *args, url,
        ]  # fmt: skip
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):  # its zygote and renderers too
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def dom(url: str) -> tuple[str, str]:
    """(the DOM once the page's scripts ran, Chromium's log with the page's console)."""
    res = _run(["--dump-dom"], url)
    return res.stdout, res.stderr


def screenshot(url: str, path: Path) -> Path:
    """Save a PNG of the page at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    res = _run([f"--screenshot={path}"], url)
    assert path.is_file() and path.stat().st_size > 10_000, res.stderr[-2000:]
    return path
