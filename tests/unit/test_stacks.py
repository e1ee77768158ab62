"""Stack dumps of a hung rank: native frames (what a thread blocked in C++ waits for) with the
Python frames, from a real process; the report's condensed form."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from trainguard.agent.workers import _short_native, dump_stacks
from trainguard.observe.report import condensed_stack

SCRIPT = """
import threading, time
def waits_on_a_lock(lock):
    lock.acquire()
lock = threading.Lock(); lock.acquire()
threading.Thread(target=waits_on_a_lock, args=(lock,), name="blocked", daemon=True).start()
print("ready", flush=True)
def sleeps_in_main():
    time.sleep(60)
sleeps_in_main()
"""


@pytest.fixture
def sleeper():  # type: ignore[no-untyped-def]
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
def test_a_dump_has_the_native_frame_each_thread_waits_in_and_its_python_frames(
    sleeper: subprocess.Popen[str],
) -> None:
    text = dump_stacks({0: sleeper.pid})[0]
    assert "sleeps_in_main" in text and "waits_on_a_lock" in text, text
    # the C calls under the Python frames: time.sleep's and the lock's
    assert "time_sleep" in text and "PyThread_acquire_lock" in text, text
    short = condensed_stack(text)
    assert "sleeps_in_main" in short and "waits_on_a_lock" in short
    assert len(short.splitlines()) < len(text.splitlines())


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
def test_a_stopped_process_still_gets_its_python_frames(sleeper: subprocess.Popen[str]) -> None:
    """py-spy cannot suspend (nor unwind natively) a SIGSTOPped process: the dump falls back to
    non-blocking Python frames within the deadline."""
    sleeper.send_signal(subprocess.signal.SIGSTOP)  # type: ignore[attr-defined]
    try:
        t0 = time.monotonic()
        text = dump_stacks({0: sleeper.pid}, timeout_s=10.0)[0]
        assert time.monotonic() - t0 < 10.5
        assert "sleeps_in_main" in text, text
    finally:
        sleeper.send_signal(subprocess.signal.SIGCONT)  # type: ignore[attr-defined]


def test_native_template_arguments_are_folded_and_python_names_kept() -> None:
    line = "    c10::function_ref<void (char**, long)>::callback_fn<at::x<int>> (libtorch_cpu.so)"
    assert _short_native(line) == "    c10::function_ref<…>::callback_fn<…> (libtorch_cpu.so)"
    for kept in ("    <module> (train.py:8)", "    Foo.<locals>.bar (x.py:3)", "    a < b"):
        assert _short_native(kept) == kept
    assert len(_short_native("    f" + "x" * 1000 + " (lib.so)")) == 300


def test_the_condensed_stack_keeps_three_native_frames_a_thread_and_its_python_frames() -> None:
    text = "\n".join([
        "Process 1: python train.py",
        'Thread 1 (idle): "MainThread"',
        "    pthread_cond_wait (libc.so.6)",
        "    take_gil (libpython3.11.so.1.0)",
        "    PyEval_RestoreThread (libpython3.11.so.1.0)",
        "    THPVariable_dropout (libtorch_python.so)",
        "    dropout (torch/nn/functional.py:1491)",
        "    <module> (train.py:8)",
        "    0x7f0aa184524a (libc.so.6)",
        'Thread 2 (idle): "reporter"',
        "    beat (trainguard/runtime/core.py:410)",
    ])  # fmt: skip
    assert condensed_stack(text).splitlines() == [
        "Process 1: python train.py",
        'Thread 1 (idle): "MainThread"',
        "    pthread_cond_wait (libc.so.6)",
        "    take_gil (libpython3.11.so.1.0)",
        "    PyEval_RestoreThread (libpython3.11.so.1.0)",
        "    dropout (torch/nn/functional.py:1491)",
        "    <module> (train.py:8)",
        'Thread 2 (idle): "reporter"',
        "    beat (trainguard/runtime/core.py:410)",
    ]
