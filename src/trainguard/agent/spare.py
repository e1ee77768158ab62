"""A warm spare worker: pre-imports torch, then waits for its rank's spec on stdin.

The agent keeps ``nproc_per_node`` of these ready, so a restart does not pay for
interpreter start and ``import torch`` (the bulk of a torchrun restart on CPU). On
its spec (one JSON line: env, argv, cwd, log, error_file) the spare redirects its
output to the rank's log, replaces its environment and runs the script as
``python SCRIPT ARGS`` would: in a fresh module that *is* ``sys.modules["__main__"]`` (and
``__mp_main__``, which multiprocessing bound to the spare's own module when torch imported
it), so classes defined in the script pickle and unpickle across spawn/forkserver workers
and pools; ``sys.argv`` and ``sys.path[0]`` as Python sets them. What torch read from the
environment at import (its intra-op thread count, ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``)
is re-read from the worker's environment, and again when the script itself imports torch
(a script may set ``OMP_NUM_THREADS`` just before ``import torch``). An uncaught exception is
written to the error file in torchelastic's format. ``mode`` "module" runs ``python -m
MODULE`` (``runpy``, ``sys.path[0]`` the working directory); "exec" (``--no-python``) replaces
the spare with the program by ``execvp``, keeping its pid and process group.

The spare dies with its agent (PR_SET_PDEATHSIG = SIGKILL, ``runtime/process.py``), as
workers die with a powered-off host; EOF on stdin (agent closed the pipe) ends an unused
spare.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib
import importlib.machinery
import json
import os
import runpy
import sys
import threading
import time
import traceback
import types
from typing import Any

from trainguard.runtime.process import die_with_parent

# The spare's last argument, ignored: room in its argv area for the rank's title (``_title``).
# setproctitle writes the title there; with SPT_NOENV it never spills into the environment
# area, which must stay readable: the agent's leftover check and the chaos runner find a job's
# processes by their environment (/proc/PID/environ), and a longer title would erase it.
TITLE_ROOM = "--title-room=" + "." * 300
EXIT_JOIN_S = 60.0  # how long a finished script's non-daemon threads may run on
# Imported before the spare is handed a rank: torch itself (~1.3 s on a 2-core CPU) and
# what a distributed training script imports next (DCP alone is ~0.8 s).
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.nn.parallel",
    # An optimizer's construction imports torch._dynamo (1.4 s here): a replica group's
    # restarted rank paid it before its heal (benchmarks/local_recovery.py).
    "torch._dynamo",
    "trainguard.checkpoint.checkpointer",
    "trainguard.runtime.replica",
)


def write_error_file(path: str, exc: BaseException) -> None:
    """torchelastic error-file format (torch.distributed.elastic.multiprocessing.errors)."""
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(time.time())),
            },
        }
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def main() -> None:
    die_with_parent(int(os.environ.get("TRAINGUARD_AGENT_PID", "0")) or os.getppid())
    # setproctitle takes over the argv area at its first call, which must come before the
    # environment is replaced (after os.environ.clear() it can no longer find the area, and
    # the rank's title would silently not be set): the waiting spare's title, now. SPT_NOENV:
    # the title stays in the argv area (TITLE_ROOM), the environment area is left whole.
    os.environ["SPT_NOENV"] = "1"
    import setproctitle

    argv = [a for a in sys.orig_argv if a != TITLE_ROOM]
    setproctitle.setproctitle(" ".join(argv) + " (warm spare, waiting for a rank)")
    for name in WARM_MODULES:  # the point of a spare: pay these imports before the fault
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    if "torch" in sys.modules:  # what a plain ``import torch`` here gives a rank
        _DEFAULT_THREADS.append(int(sys.modules["torch"].get_num_threads()))
    line = sys.stdin.readline()
    if not line:
        return
    spec = json.loads(line)
    fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    mode = spec.get("mode", "script")  # script | module (python -m) | exec (--no-python)
    _title(spec["argv"], spec["env"])
    if mode == "exec":
        _exec(spec["argv"], spec["error_file"])
    script = spec["argv"][0]
    sys.argv = list(spec["argv"])
    # python SCRIPT puts the script's directory first on sys.path; python -m, the cwd.
    sys.path[0] = os.getcwd() if mode == "module" else os.path.dirname(os.path.abspath(script))
    _apply_thread_env()
    _reapply_thread_env_on_torch_import()
    code: int | str | None = 0
    try:
        if mode == "module":
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            _run_as_main(script)
    except SystemExit as e:
        code = e.code
    except BaseException as exc:
        write_error_file(spec["error_file"], exc)
        traceback.print_exc()
        code = 1
    _exit(code)


def title_of(argv: list[str], env: dict[str, str]) -> str:
    """What ``ps`` shows for a rank's worker: ``trainguard rank 1/4 (local 1, gen 0) train.py
    --lr 3e-4 [run RUN_ID]`` (``argv``: the script and its arguments as started; ``env``: the
    worker's environment). Its environment in ``/proc/PID/environ`` is the spare's, from
    before it was handed the rank, so the title is where a person finds rank 1's pid."""
    what = " ".join([os.path.basename(argv[0]), *argv[1:]]) if argv else "?"
    return (
        f"trainguard rank {env.get('RANK', '?')}/{env.get('WORLD_SIZE', '?')} "
        f"(local {env.get('LOCAL_RANK', '?')}, gen {env.get('TRAINGUARD_GENERATION', '?')}) "
        f"{what[:200]} [run {env.get('TORCHELASTIC_RUN_ID', '?')}]"
    )


def _title(argv: list[str], env: dict[str, str]) -> None:
    """Set this process's title (``title_of``) with setproctitle, which rewrites the argv
    area ``ps`` reads (``/proc/PID/cmdline``) and the thread name (``/proc/PID/comm``;
    ``main`` made its first call)."""
    import setproctitle

    setproctitle.setproctitle(title_of(argv, env))


def _exec(argv: list[str], error_file: str) -> None:
    """``--no-python``: become the worker program itself (same pid, process group, output,
    environment and directory the agent set up); never returns."""
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        write_error_file(error_file, e)
        print(f"trainguard: cannot execute {argv[0]!r}: {e}", file=sys.stderr, flush=True)
        os._exit(127)


def _run_as_main(script: str) -> None:
    """Execute ``script`` as ``python script`` does: compiled from its file, in a new module
    installed as ``__main__`` (and ``__mp_main__``) for as long as the process lives."""
    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
    main.__spec__ = None  # as for a script run by path: spawn children re-run it by path
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    _SPARE.append(sys.modules["__main__"])  # this module stays alive (its functions run on)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main
    with open(script, "rb") as f:
        source = f.read()
    exec(compile(source, script, "exec"), main.__dict__)


_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_DEFAULT_THREADS: list[int] = []  # torch's intra-op threads at the spare's import
_SPARE: list[types.ModuleType] = []


def _apply_thread_env() -> None:
    """Set torch's intra-op threads as ``import torch`` would have from this environment:
    ``OMP_NUM_THREADS`` (or ``MKL_NUM_THREADS``), else torch's own default, as the spare's
    import found it (the agent starts spares without either unless the user set them)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for name in _THREAD_ENV:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            torch.set_num_threads(int(value))
            return
    if _DEFAULT_THREADS:
        torch.set_num_threads(_DEFAULT_THREADS[0])


def _reapply_thread_env_on_torch_import() -> None:
    """torch is imported already, so the script's own ``import torch`` runs nothing: catch
    it and re-read the thread variables then (the import hook removes itself)."""
    original = builtins.__import__

    def hook(name: str, *args: Any, **kwargs: Any) -> Any:
        module = original(name, *args, **kwargs)
        if name == "torch" or name.startswith("torch."):
            builtins.__import__ = original
            _apply_thread_env()
        return module

    builtins.__import__ = hook


def _exit(code: int | str | None) -> None:
    """End the worker as a multiprocessing child does: join non-daemon threads (bounded),
    run atexit handlers, flush, then ``os._exit``. Skipping the interpreter's final GC and
    module teardown matters: with torch loaded it took seconds on a busy 2-core machine,
    during which the rank looked hung."""
    deadline = time.monotonic() + EXIT_JOIN_S
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    try:
        atexit._run_exitfuncs()
    finally:
        if isinstance(code, str):
            print(code, file=sys.stderr)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


if __name__ == "__main__":
    main()
