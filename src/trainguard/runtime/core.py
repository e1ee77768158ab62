"""The worker runtime: step boundaries, heartbeats and reports, injected faults.

Usage in a training script::

    rt = trainguard.init()
    for step in range(start, steps):
        ...                               # forward, backward, optimizer
        trainguard.step_end(step, loss=loss.item(), tokens=n)

Optional timing of named sections (``with rt.section("forward"):``) and of collectives
(``with rt.collective():``, or ``time_ddp(ddp)`` for DDP's gradient all-reduce) rides on
each step record: the controller tells a slow rank (long compute) from the ranks that
wait for it (long communication). Cost: two ``perf_counter`` calls per section.

Outside ``trainguard run`` (plain python or torchrun) every call is a cheap no-op
apart from step timing. Under it, a daemon thread named ``trainguard-reporter``
sends a heartbeat every ``TRAINGUARD_HEARTBEAT_S`` seconds and forwards step
records to the node agent over UDP; the training thread only appends to a queue.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from trainguard.faults.inject import InjectSpec, loads
from trainguard.protocol import clock
from trainguard.protocol.report import StepRecord
from trainguard.protocol.worker import (
    Alive,
    Batch,
    Heartbeat,
    Item,
    Sender,
    StepEnd,
    WorkerEvent,
    WorkerMessage,
)
from trainguard.runtime import api, wire

# A step's record as the training thread queues it: (step, t_end, duration_s, loss, tokens,
# grad_norm, sections, t_coll, gap), the fields of StepRecord in order.
StepTuple = tuple[
    int, float, float, float | None, int | None, float | None, dict[str, float], float | None,
    float | None,
]  # fmt: skip


class Runtime:
    """Per-process runtime handle. Create with :func:`trainguard.init`."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        self._read_env(env)
        self._heartbeat_s = float(env.get(api.ENV_HEARTBEAT_S, api.DEFAULT_HEARTBEAT_S))
        # What the training thread queues for the reporter: a step's record as it is (one
        # object built per step), the other messages as sent.
        self._queue: queue.SimpleQueue[Item | StepTuple] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._sock: socket.socket | None = None
        self._agent: tuple[str, int] | None = None
        self._token = b""
        self._thread: threading.Thread | None = None
        self.timing = True  # sections and collectives timed (False: skipped, for A/B)
        self._sec_lock = threading.Lock()  # collectives complete on gloo's threads
        self._send_lock = threading.Lock()  # a batch leaves under the generation it was made in
        self._main_ident = threading.main_thread().ident
        self.total_steps: int | None = None  # the step the script ends at, if it said
        self._wrong_gemm: Any = None  # the gemm-wrong drill's mode, once it fired
        # In-process recovery (runtime/inprocess.py): the script runs under trainguard.run;
        # parked: it left its training function after a fault and waits for a Resume.
        self.inprocess = False
        self.parked = False
        # What the training function made that an in-process recovery must release
        # (Checkpointers: their slots, ckptd connection, optimizer hooks).
        self.owned: weakref.WeakSet[Any] = weakref.WeakSet()
        addr = env.get(api.ENV_AGENT_ADDR)
        if addr:
            host, _, port = addr.rpartition(":")
            self._agent = (host, int(port))
            self._token = bytes.fromhex(env.get(api.ENV_TOKEN, ""))
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            # Bound now (not at the first send): the agent answers to this address (Abort,
            # Resume: protocol/control.py).
            self._sock.bind((host, 0))
            self._thread = threading.Thread(
                target=self._report_loop, name="trainguard-reporter", daemon=True
            )
            self._thread.start()
            # The reporter is a daemon thread: at exit, what it has not sent yet (the last
            # steps of a script that ends right after them) is sent here, or the controller
            # would judge the ranks by a step they passed long ago ("stopped early").
            atexit.register(self._flush)
        for spec in self._injects:  # a node's defect: its GEMMs stay wrong (once a process)
            due = (spec.step or 0) <= self.next_step()
            if spec.kind == "gemm-wrong" and self._wrong_gemm is None and due:
                self._gemm_goes_wrong(spec, self.next_step() - 1)

    def _read_env(self, env: dict[str, str]) -> None:
        """This process's rank, world, generation, restore point and drills from ``env``, and
        every per-generation counter at its start (``__init__``, and ``reset`` when an
        in-process recovery resumes the script as a new generation)."""
        self.rank = int(env.get("RANK", "0"))
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.world_size = int(env.get("WORLD_SIZE", "1"))
        self.node_rank = int(env.get("GROUP_RANK", "0"))
        self.generation = int(
            env.get(api.ENV_GENERATION, env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        )
        self.run_dir: str | None = env.get(api.ENV_RUN_DIR) or None
        restore = env.get(api.ENV_RESTORE_STEP, "")
        self.restore_step: int | None = int(restore) if restore else None
        self._node_id = env.get(api.ENV_NODE_ID, "")
        self._injects = [s for s in loads(env.get(api.ENV_INJECT, "")) if self._targets_me(s)]
        self._last_end = clock.wall()
        self._last_step: int | None = None
        self._slow_debt_s = 0.0
        self._steps_ended = 0  # in this generation (its first step includes start-up)
        self._sections: dict[str, float] = {}  # this step's seconds per section
        # Collectives issued and completed by this rank (hang localization: the rank that did
        # not issue the collective the others wait in is the one holding them).
        self.coll_issued = 0
        self.coll_done = 0
        self._first_issue: float | None = None
        self._last_done: float | None = None  # when its newest collective completed
        self._gap: float | None = None
        self._phases: list[str] = []  # open rt.phase(...) blocks, innermost last

    def reset(self, env: dict[str, str]) -> None:
        """Become generation ``env``'s (an in-process recovery resumes the script): what was
        queued for the old generation leaves under it first, then every counter restarts."""
        with self._send_lock:
            self._drain_locked()
            self._read_env(env)
        for spec in self._injects:  # a node's defect: its GEMMs stay wrong (once a process)
            due = (spec.step or 0) <= self.next_step()
            if spec.kind == "gemm-wrong" and self._wrong_gemm is None and due:
                self._gemm_goes_wrong(spec, self.next_step() - 1)

    @property
    def supervised(self) -> bool:
        """True when running under a trainguard agent."""
        return self._agent is not None

    def _targets_me(self, spec: InjectSpec) -> bool:
        if spec.kind == "node-down":
            return spec.node == self.node_rank and self.local_rank == 0
        if spec.kind in ("loss-spike", "nan"):
            return True  # the data of every rank
        if spec.kind == "gemm-wrong":
            return self._node_id == f"node{spec.node}"  # every rank of that node
        return spec.rank == self.rank

    def next_step(self) -> int:
        """The step this process computes next: one past its last ``step_end``, else past
        the restore point (1 for a fresh start)."""
        last = self._last_step if self._last_step is not None else (self.restore_step or 0)
        return last + 1

    # ---------------------------------------------------------------- timing
    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time a named part of the step (``data``, ``forward``, ``backward``, ``optimizer``…):
        its seconds are added to this step's record. Nested sections each count in full."""
        if not self.timing:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(name, time.perf_counter() - t0)

    def add_time(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to this step's section ``name`` (thread-safe)."""
        with self._sec_lock:
            self._sections[name] = self._sections.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Wrap a blocking collective (e.g. ``dist.all_reduce``): counts it (issued, done) and
        adds its time, waiting for peers included, to the ``communication`` section."""
        t0 = self.collective_issue()
        try:
            yield
        finally:
            self.collective_done(t0)

    def collective_issue(self) -> float:
        """A collective is about to be issued; returns its start time for ``collective_done``.
        (An injected ``hang-collective`` stops this rank here, before it issues.)"""
        for spec in self._injects:
            if spec.kind == "hang-collective" and spec.step == (self._last_step or 0) + 1:
                self._maybe_fire(spec, spec.step, 0.0)
        self.coll_issued += 1
        if self._first_issue is None:
            now = clock.wall()  # this rank reached the step's first collective
            self._first_issue = now
            if self._last_done is not None:  # own work since its previous collective ended
                self._gap = now - self._last_done
        return time.perf_counter()

    def collective_done(self, t0: float) -> None:
        self.coll_done += 1
        self._last_done = clock.wall()
        if self.timing:
            self.add_time("communication", time.perf_counter() - t0)

    def sdc_drill(self, step: int) -> InjectSpec | None:
        """An injected ``sdc`` of a parameter or optimizer state due at a checkpoint save of
        ``step`` (its step reached), once per process; its ``inject_fired`` event is sent
        before the caller flips the bit."""
        for spec in self._injects:
            if (
                spec.kind == "sdc"
                and spec.target != "grad"
                and spec.step is not None
                and spec.step <= step
            ):
                self.fire(spec, step)
                return spec
        return None

    def grad_drill(self) -> InjectSpec | None:
        """The armed ``sdc:…:target=grad`` of this rank, if any (not fired: ``fire`` it)."""
        return next((s for s in self._injects if s.kind == "sdc" and s.target == "grad"), None)

    def fire(self, spec: InjectSpec, step: int) -> None:
        """Disarm ``spec`` in this process and send its ``inject_fired`` (synchronously)."""
        self._injects = [s for s in self._injects if s is not spec]
        self._fired(spec, step)

    def _gemm_goes_wrong(self, spec: InjectSpec, step: int) -> None:
        """The ``gemm-wrong`` drill fires after ``step`` (its ``inject_fired`` names the step
        completed, as every drill's does): this thread's matrix products go wrong for the
        rest of the process (``faults.gemm.WrongGemm``)."""
        from trainguard.faults.gemm import WrongGemm

        self.fire(spec, step)
        self._wrong_gemm = WrongGemm()
        self._wrong_gemm.__enter__()

    def drill(self, step: int) -> str | None:
        """The data fault injected at ``step`` (``loss-spike`` or ``nan``), for the script to
        apply to that step's real data or loss; None almost always."""
        for spec in self._injects:
            if spec.kind in ("loss-spike", "nan") and spec.step == step:
                return spec.kind
        return None

    # ---------------------------------------------------------------- training thread
    def step_end(
        self,
        step: int,
        *,
        loss: float | None = None,
        tokens: int | None = None,
        grad_norm: float | None = None,
    ) -> None:
        """Mark the end of training step ``step`` (after the optimizer update).

        Cost on the training thread: two clock reads and a queue append. ``loss`` is the
        step's scalar loss, ``tokens`` the tokens this rank processed in the step,
        ``grad_norm`` the total gradient norm (what ``clip_grad_norm_`` returns; the
        controller's silent-corruption check watches it, see controller/analysis.py).
        """
        now = clock.wall()
        duration = now - self._last_end
        self._last_end = now
        self._last_step = step
        self._steps_ended += 1
        with self._sec_lock:
            sections, self._sections = self._sections, {}
        t_coll, self._first_issue = self._first_issue, None
        gap, self._gap = self._gap, None
        if self._agent is not None:
            # A tuple here (a dataclass costs several µs on this thread); the reporter thread
            # makes it a StepRecord in a StepEnd and encodes it.
            self._queue.put((step, now, duration, loss, tokens, grad_norm, sections, t_coll, gap))
        for spec in self._injects:
            self._maybe_fire(spec, step, duration)

    def keepalive(self) -> None:
        """Tell the agent this rank is busy but not hung (e.g. waiting, under its own deadline,
        for a checkpoint to become durable or for its node's ckptd): resets its hang timer
        without a new step, and marks the rank as waiting on trainguard, so that the peers
        it holds up in a collective are not called hung either."""
        if self._agent is not None:
            self._queue.put(Alive())

    def event(self, kind: str, **data: Any) -> None:
        """Send a structured event (e.g. ``ckpt_load_end``) to the agent, off the training thread."""
        if self._agent is not None:
            self._queue.put(WorkerEvent(kind=kind, ts=clock.wall(), data=data))

    def event_now(self, kind: str, **data: Any) -> None:
        """Send an event synchronously, for one the process may not outlive (an error it is
        about to raise): on loopback the datagram is in the agent's buffer when this returns."""
        with contextlib.suppress(OSError):
            self._send_now(WorkerEvent(kind=kind, ts=clock.wall(), data=data))

    def beat_now(self) -> None:
        """Send a heartbeat synchronously (a change the agent must know before the next beat:
        the opt-in to in-process recovery, which a fault a moment later is planned by)."""
        with contextlib.suppress(OSError), self._send_lock:
            self._send_now(self._beat())

    def _send_now(self, message: WorkerMessage) -> None:
        if self._sock is not None and self._agent is not None:
            sender = Sender(rank=self.rank, pid=os.getpid(), generation=self.generation)
            self._sock.sendto(wire.encode_message(self._token, sender, message), self._agent)

    def _fired(self, spec: InjectSpec, step: int) -> None:
        """Tell the agent ``spec`` fires at ``step``. Delivered synchronously: on loopback the
        datagram sits in the agent's socket buffer before the fault happens."""
        data = {"inject": spec.to_json(), "step": step}
        self._send_now(WorkerEvent(kind="inject_fired", ts=clock.wall(), data=data))

    def _maybe_fire(self, spec: InjectSpec, step: int, duration: float) -> None:
        if spec.kind == "sdc":
            return  # fired by the Checkpointer at a save (sdc_drill) or in a backward
        if spec.kind == "gemm-wrong":
            if spec.step is not None and step + 1 >= spec.step:
                self._gemm_goes_wrong(spec, step)  # after this step: the next is wrong
            return
        if spec.kind == "slow":
            # Sleep so that this step takes `factor` times its compute time (from the second
            # step of the process on: the first one's duration includes start-up).
            if self._steps_ended < 2 or (spec.step is not None and step < spec.step):
                return
            compute = max(0.0, duration - self._slow_debt_s)
            self._slow_debt_s = compute * (spec.factor - 1.0)
            time.sleep(self._slow_debt_s)  # counted in the next step's duration
            return
        if spec.step != step:
            return
        self._fired(spec, step)
        sys.stdout.flush()
        sys.stderr.flush()
        if spec.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.kind == "exit":
            os._exit(spec.code)
        elif spec.kind in ("hang", "node-down", "hang-collective"):
            # Stop making progress; the reporter thread keeps heartbeating. For node-down
            # the agent SIGKILLs this process; the deadline bounds the wait regardless.
            deadline = time.monotonic() + (60.0 if spec.kind == "node-down" else 3600.0)
            while time.monotonic() < deadline:
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)

    # ---------------------------------------------------------------- reporter thread
    def _report_loop(self) -> None:
        next_beat = 0.0
        while not self._closed.is_set():
            batch: list[Item | StepTuple] = []
            timeout = max(0.0, next_beat - time.monotonic())
            try:
                batch.append(self._queue.get(timeout=timeout))
                while len(batch) < 64:
                    batch.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            with self._send_lock:  # reset() changes the generation between batches only
                if time.monotonic() >= next_beat:
                    batch.append(self._beat())
                    next_beat = time.monotonic() + self._heartbeat_s
                # Agent gone: heartbeats resume if it returns; nothing is lost here.
                with contextlib.suppress(OSError):
                    self._send_now(_batch(batch))

    def _beat(self) -> Heartbeat:
        fingerprint = None
        # The heartbeat is this rank's life to its agent: never let it die (a beat without a
        # fingerprint reads as no progress).
        with contextlib.suppress(Exception):
            fingerprint = self._main_fingerprint()
        return Heartbeat(
            ts=clock.wall(),
            step=self._last_step,
            coll=(self.coll_issued, self.coll_done),
            cpu_s=self._main_cpu_s(),
            fingerprint=fingerprint,
            phase=self._phases[-1] if self._phases else None,
            total_steps=self.total_steps,
            inprocess=self.inprocess,
            parked=self.parked,
        )

    def _main_fingerprint(self) -> int:
        """Where the main thread is: a hash of (file, line) of its innermost frames (16, or
        only the innermost on Python 3.11). It changes while the script runs Python code (an
        evaluation, an epilogue) and stays put while the thread is blocked in one call (a
        stuck collective, a deadlock).

        On 3.11, ``f_back`` of another thread's frame can read a frame that thread is still
        setting up and crash the process (CPython gh-99110, gh-111363: a rank here died of
        SIGSEGV after its reporter thread read a dict where a frame was due); the innermost
        frame, made by ``sys._current_frames`` under the GIL, is safe."""
        frame = sys._current_frames().get(self._main_ident or -1)
        depth = 16 if sys.version_info >= (3, 12) else 1
        where = []
        while frame is not None and len(where) < depth:
            where.append((frame.f_code.co_filename, frame.f_lineno))
            frame = frame.f_back if len(where) < depth else None
        return hash(tuple(where)) & 0x7FFFFFFF

    def _main_cpu_s(self) -> float | None:
        """CPU seconds the main thread has used (None where the OS cannot tell)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._main_ident or 0))
        except (AttributeError, OSError):
            return None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a long part of the script without step reports (``with rt.phase("eval"):``):
        while a fresh heartbeat says the rank is alive it is not called hung, however long the
        phase lasts. A frozen process (no heartbeat) still is. Nested phases are fine."""
        self._phases.append(name)
        try:
            yield
        finally:
            self._phases.pop()

    def _flush(self) -> None:
        """Send every queued report now (atexit; bounded by the queue's length)."""
        with self._send_lock:
            self._drain_locked()

    def _drain_locked(self) -> None:
        batch: list[Item | StepTuple] = []
        with contextlib.suppress(queue.Empty, OSError):
            while True:
                batch.append(self._queue.get_nowait())
                if len(batch) == 64:
                    self._send_now(_batch(batch))
                    batch = []
        with contextlib.suppress(OSError):
            if batch:
                self._send_now(_batch(batch))

    def close(self) -> None:
        """Stop the reporter thread (joined with a 2 s deadline) and send what it left."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._flush()
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _step_end(q: StepTuple) -> StepEnd:
    step, t_end, duration, loss, tokens, grad_norm, sections, t_coll, gap = q
    return StepEnd(
        StepRecord(step=step, t_end=t_end, duration_s=duration, loss=loss, tokens=tokens,
                   grad_norm=grad_norm, sections=sections, t_coll=t_coll, gap=gap)
    )  # fmt: skip


def _batch(queued: list[Item | StepTuple]) -> Batch:
    return Batch(tuple(_step_end(it) if isinstance(it, tuple) else it for it in queued))


_runtime: Runtime | None = None
_lock = threading.Lock()


def init(*, total_steps: int | None = None) -> Runtime:
    """Return this process's runtime, creating it on first call (idempotent, thread-safe).

    ``total_steps``: the step the script ends at. With it, ranks that all exit 0 before
    reaching it (an outside SIGTERM, a preemption) are a stopped job, not a finished one.
    Raises ValueError for a ``total_steps`` below 1."""
    global _runtime
    if total_steps is not None and total_steps < 1:
        raise ValueError(f"total_steps={total_steps}: must be >= 1")
    with _lock:
        if _runtime is None:
            _runtime = Runtime()
        if total_steps is not None:
            _runtime.total_steps = total_steps
        return _runtime


def step_end(
    step: int,
    *,
    loss: float | None = None,
    tokens: int | None = None,
    grad_norm: float | None = None,
) -> None:
    """Module-level shortcut for ``init().step_end(...)``."""
    init().step_end(step, loss=loss, tokens=tokens, grad_norm=grad_norm)
