"""Shared fixtures: run trainguard for real and check that a test leaves nothing behind."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
# Test this checkout's code, in this process and in every process it starts, whichever
# checkout an editable install happens to point at.
sys.path.insert(0, str(ROOT / "src"))
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])
)
from tests import diagnose  # noqa: E402
from trainguard.chaos import faults as chaos_faults  # noqa: E402  (this checkout's)
from trainguard.chaos import run as chaos_run  # noqa: E402

if TYPE_CHECKING:
    from trainguard.faults.netns import Hosts

GPT = ROOT / "examples" / "gpt" / "train.py"
# A GPT small enough for a 2-core machine: ~10-20 ms per step with 2 ranks.
TINY = [
    "--n-embd",
    "32",
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--data-max-bytes",
    "200000",
    "--dropout",
    "0.1",
]
# The paced job of the own-parts fault tests: rank 0's steps 5x longer (a sleep; the losses do
# not change), so the job is still training when a fault, its detection and its recovery are
# over; a snapshot every 5 steps (its replica reaches the peer before the next), durable every 10.
PACE = ["--inject", "slow:rank=0:factor=5"]
PACED_STEPS = 120
PACED_ARGS = [*TINY, "--steps", str(PACED_STEPS), "--ckpt-every", "5", "--durable-every", "10"]
# Short timeouts so faults are seen in seconds: the chaos command's own (chaos/run.py).
FAST_CONFIG = chaos_run.FAST_CONFIG + "warm_spares = 0\n"
# warm_spares = 0: an agent keeps no spare worker started ahead of a restart; a restart starts
# its workers as spares handed their rank at once (the same agent/spare.py path, without the
# head start). An unused spare costs a torch import (~2-5 s of CPU here) and half of the CPU of
# the slow tests went to spares, most never used; tests of what warm spares are for (a restart
# that does not wait for imports) use WARM_CONFIG, the product's default.
WARM_CONFIG = chaos_run.FAST_CONFIG
# (probe_every_s = 0: no in-job GEMM probe process beside each test's workers, a torch import
# per node and generation; tests/integration/test_sdc.py turns it on where it is the subject.)
# The same with pre-flight checks on (tests of the pre-flight itself).
PREFLIGHT_CONFIG = FAST_CONFIG.replace('preflight = "off"', 'preflight = "quick"')


# The longest tests after chaos (CI's slow run, 2026-12-07: 2-6 min each under load), started
# early for the same reason; the Slurm tests share one cluster on one worker (loadgroup).
LONG_FIRST = (
    "test_slurm.py::",
    "::test_repeated_recoveries_leave_threads_fds_and_shm_where_they_were",
    "::test_ckptd_frozen_under_the_agents_preverify_is_killed_and_each_rank_verifies_itself",
    "::test_a_partition_between_replica_groups_leaves_out_the_side_without_the_store",
    "::test_world_change_reshards_the_durable_checkpoint",
    "::test_the_recovery_benchmark_smoke_run_prints_its_keys",
    "::test_the_straggler_benchmark_smoke_run_prints_its_keys",
    "::test_the_node_recovery_benchmark_smoke_run_prints_its_keys",
    "::test_the_sdc_benchmark_smoke_run_prints_its_keys",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The chaos test (minutes of faults, the longest by far) first, then LONG_FIRST: run two
    at a time (-n 2), a long test started last leaves one worker idle for its length. The
    rest in collection order, rotated by ``TRAINGUARD_CI_ROTATE`` (an integer; .ci/run sets
    the commit's) when set: the tests CI's time budget leaves out (``pytest_runtest_setup``)
    differ from one commit to the next. The same order on every xdist worker."""

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("chaos") is not None:
            return 0
        return 1 if any(k in item.nodeid for k in LONG_FIRST) else 2

    items.sort(key=rank)
    rest = [i for i in items if rank(i) == 2]
    k = int(os.environ.get("TRAINGUARD_CI_ROTATE") or 0) % max(1, len(rest))
    items[len(items) - len(rest) :] = rest[k:] + rest[:k]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """CI's time budget (.ci/run): past ``TRAINGUARD_CI_DEADLINE`` (Unix time, seconds) a slow
    test that has not started is skipped, with the reason in the summary (-ra). The default
    suite is never skipped; .ci/run sets a deadline for its slow and alone runs only."""
    deadline = os.environ.get("TRAINGUARD_CI_DEADLINE")
    if deadline and item.get_closest_marker("slow") is not None and time.time() > float(deadline):
        pytest.skip(
            f"{item.nodeid}: CI's time budget for slow tests is spent (.ci/run, "
            "TRAINGUARD_CI_DEADLINE); their order rotates with the commit "
            "(TRAINGUARD_CI_ROTATE): another commit's CI runs it"
        )


def run_process(p: psutil.Process, tag: str) -> bool:
    """Is ``p`` a process of the test whose tmp dir is ``tag``: its command line or environment
    names it? (False for one gone or not readable.)"""
    try:
        return tag in " ".join(p.cmdline()) or any(tag in v for v in p.environ().values())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


# This process's own temporary files stay in the system's directory: pinned before TMPDIR is
# set below (tempfile reads it once, at its first use). The processes this session starts
# outside a test (module fixtures' reference runs) put theirs in a directory of the session,
# removed at its end (pytest_sessionfinish); each test's, in one of its own (no_leaks).
tempfile.gettempdir()
SESSION_TMP = Path(tempfile.mkdtemp(prefix="tgtest-s-"))
os.environ["TMPDIR"] = str(SESSION_TMP)


def pytest_sessionfinish(session: pytest.Session) -> None:
    shutil.rmtree(SESSION_TMP, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a test that leaves a process, zombie, /dev/shm segment or mount (under its tmp
    dir) of its own behind.

    The processes it starts get a TMPDIR of their own, removed after it: what torchrun
    (``/tmp/torchelastic_*``, never removed by torchrun) and multiprocessing (``/tmp/pymp-*``,
    left by a SIGKILLed process) leave goes with it. Short (``/tmp/tgtest-…``, not under
    ``tmp_path``): multiprocessing puts Unix sockets there, whose paths fit in 107 bytes."""
    tag = str(tmp_path)
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}
    shm_before = set(os.listdir("/dev/shm"))
    tmp = tempfile.mkdtemp(prefix="tgtest-")
    monkeypatch.setenv("TMPDIR", tmp)
    diagnose.set_test_dir(tmp_path)  # what a timed-out wait_for shows
    yield
    diagnose.set_test_dir(None)
    try:
        _check_leaks(tag, tmp_path, me, mine, shm_before)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_leaks(
    tag: str, tmp_path: Path, me: psutil.Process, mine: set[int], shm_before: set[str]
) -> None:
    deadline = time.monotonic() + 15.0
    leaked: list[psutil.Process] = []
    while time.monotonic() < deadline:
        leaked = [p for p in psutil.process_iter() if p.pid not in mine and run_process(p, tag)]
        if not leaked:
            break
        time.sleep(0.2)
    for p in leaked:  # clean up so one leak does not fail the next test too
        with contextlib.suppress(ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            os.killpg(p.pid, 9) if os.getpgid(p.pid) == p.pid else p.kill()
    zombies = [c for c in me.children(recursive=True) if c.status() == psutil.STATUS_ZOMBIE]
    for z in zombies:  # reaped, so one leak does not fail the next test too
        with contextlib.suppress(ChildProcessError):
            os.waitpid(z.pid, os.WNOHANG)
    # Segments are named trainguard-<sha1(run dir)[:8]>-…: count only this test's run dirs.
    jobs = {
        hashlib.sha1(str(d.resolve()).encode()).hexdigest()[:8]
        for d in [tmp_path, *tmp_path.rglob("*")]
        if d.is_dir() and not d.is_symlink()
    }
    new_shm = [
        n
        for n in set(os.listdir("/dev/shm")) - shm_before
        if any(f"trainguard-{j}-" in n for j in jobs)
    ]
    assert not leaked, (
        f"processes left behind: {[(p.pid, _cmd(p)) for p in leaked if p.is_running()]}"
    )
    assert not zombies, f"zombies left behind: {zombies}"
    mounts = _mounts_under(tmp_path)
    for m in reversed(mounts):  # unmounted, so one leak does not fail the next test too
        subprocess.run(["umount", "-l", m], check=False)
    assert not new_shm, f"/dev/shm segments left behind: {new_shm}"
    assert not mounts, f"mounts left behind: {mounts}"


def _mounts_under(d: Path) -> list[str]:
    """Mount points at or below ``d``, in /proc/self/mounts order (octal escapes kept)."""
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    top = str(d.resolve())
    return [p for p in points if p == top or p.startswith(top + "/")]


def drop_segments(pattern: str) -> None:
    """Remove /dev/shm entries matching ``pattern`` (slots are files, a standby's prefetched
    step a directory): what a killed host or a failed test left in memory."""
    for seg in Path("/dev/shm").glob(pattern):
        if seg.is_dir():
            shutil.rmtree(seg, ignore_errors=True)
        else:
            seg.unlink(missing_ok=True)


def _cmd(p: psutil.Process) -> list[str] | str:
    try:
        return p.cmdline()
    except psutil.Error as e:  # a zombie has no command line left
        return f"({type(e).__name__})"


def trainguard_cmd(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "trainguard", *map(str, args)]


def run_job(
    run_dir: Path,
    run_args: list[str],
    script_args: list[str],
    *,
    timeout: float = 240.0,
    config: str = FAST_CONFIG,
) -> subprocess.CompletedProcess[str]:
    """Run ``trainguard run`` to completion (killed at ``timeout``) and return its result."""
    cfg = run_dir.parent / f"{run_dir.name}.toml"
    cfg.write_text(config)
    cmd = trainguard_cmd("run", "--run-dir", run_dir, "--config", cfg, *run_args, GPT, *script_args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def start_job(
    run_dir: Path, run_args: list[str], script_args: list[str], *, config: str = FAST_CONFIG
) -> subprocess.Popen[str]:
    cfg = run_dir.parent / f"{run_dir.name}.toml"
    cfg.write_text(config)
    cmd = trainguard_cmd("run", "--run-dir", run_dir, "--config", cfg, *run_args, GPT, *script_args)
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )


REFERENCE_LOCK_S = 900.0  # the longest reference run a test waits for (another worker's)


def fault_free_losses(
    tmp_path_factory: pytest.TempPathFactory, run_args: list[str], script_args: list[str]
) -> dict[int, float]:
    """Run the example once without faults and return its per-step losses (the reference a
    faulty run must match, step for step).

    One run serves the whole test session, both xdist workers and every module: the losses
    of a step do not depend on how many steps follow it (constant learning rate, data and
    dropout drawn per step; checked by ``test_reference_losses_are_a_prefix_of_a_longer_run``),
    so a reference of N steps is the first N losses of any run with the same ``run_args`` and
    other script flags. Runs are cached under the session's base temp dir (never across
    sessions: the code may have changed), or under ``$TRAINGUARD_TEST_REFERENCES`` where set:
    CI's runs of one checkout (the default suite, then the slow one) share their references.
    One writer at a time per key (a flock; waits at most REFERENCE_LOCK_S, then TimeoutError)."""
    steps, rest = _without_steps(script_args)
    key = hashlib.sha1(json.dumps([run_args, rest]).encode()).hexdigest()[:16]
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    if os.environ.get("TRAINGUARD_TEST_REFERENCES"):
        shared = Path(os.environ["TRAINGUARD_TEST_REFERENCES"])
    cache = shared / "reference-losses" / key
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "lock", "w") as lock:
        deadline = time.monotonic() + REFERENCE_LOCK_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"reference {cache} locked past {REFERENCE_LOCK_S}s"
                    ) from None
                time.sleep(0.2)
        for f in cache.glob("losses-*.json"):
            have = {int(k): v for k, v in json.loads(f.read_text()).items()}
            if steps is not None and len(have) >= steps:
                return {k: v for k, v in have.items() if k <= steps}
            if steps is None and f.name == "losses-all.json":
                return have
        run_dir = tmp_path_factory.mktemp("reference") / "run"
        res = run_job(run_dir, run_args, script_args, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        got = losses(run_dir)
        tmp = cache / "losses.tmp"
        tmp.write_text(json.dumps(got))
        tmp.replace(cache / f"losses-{steps if steps is not None else 'all'}.json")
        return got


def _without_steps(script_args: list[str]) -> tuple[int | None, list[str]]:
    """(the value of ``--steps``, the other arguments)."""
    if "--steps" not in script_args:
        return None, list(script_args)
    i = script_args.index("--steps")
    return int(script_args[i + 1]), [*script_args[:i], *script_args[i + 2 :]]


def finish_job(proc: subprocess.Popen[str], timeout: float = 240.0) -> tuple[int, str]:
    """Wait for a started job; (exit status, stderr). Killed, and an AssertionError with its
    stderr's tail, past ``timeout`` seconds."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"job did not finish in {timeout}s:\n{err[-3000:]}") from None
    return proc.returncode, err


events = chaos_faults.events  # the run's events.jsonl, a line being written skipped


def losses(run_dir: Path) -> dict[int, float]:
    """Per-step loss from metrics.jsonl; after a restart the last line for a step counts."""
    out: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{diagnose.account()}")


def worker_pid(run_dir: Path, rank: int, generation: int = 0) -> int:
    ev = wait_for(
        lambda: [
            e
            for e in events(run_dir)
            if e["kind"] in ("worker_started", "worker_resumed")
            and e["rank"] == rank
            and e["generation"] == generation
        ],
        60,
        f"rank {rank} to start",
    )
    return int(ev[-1]["pid"])


def reached_step(run_dir: Path, step: int) -> bool:
    """Has the run's metrics.jsonl a line of ``step`` or later? (read incrementally: polled)"""
    return any(s >= step for s, _, _ in chaos_faults.metrics(run_dir))


def report(run_dir: Path) -> dict[str, Any]:
    out = subprocess.run(
        trainguard_cmd("report", "--run-dir", run_dir, "--json"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def agent_pid(run_dir: Path, node_id: str) -> int:
    """The pid of the agent of ``node_id`` of the job in ``run_dir`` (waits up to 30 s)."""

    def find() -> int | None:
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "agent" in cmd and node_id in cmd and str(run_dir) in cmd:
                return p.pid
        return None

    return int(wait_for(find, 30, f"agent {node_id}"))


@contextlib.contextmanager
def strace_attached(pid: int, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """strace attached to every thread of ``pid`` (and the threads it starts), with ``args``
    (its filters and injections, e.g. ``-e inject=openat:signal=STOP``: a real signal at one
    system call), from the moment every thread is traced (30 s deadline); terminated after.
    Skips without strace."""
    if shutil.which("strace") is None:
        pytest.skip("needs strace (it puts a real SIGKILL/SIGSTOP at one system call)")
    s = subprocess.Popen(["strace", "-qq", "-f", "-o", "/dev/null", "-p", str(pid), *args])

    def traced() -> bool:
        tracers = set()
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, IndexError):
                line = task.joinpath("status").read_text().split("TracerPid:")[1]
                tracers.add(int(line.split()[0]))
        return tracers == {s.pid}

    try:
        wait_for(lambda: s.poll() is not None or traced(), 30, "strace to attach")
        assert s.poll() is None, "strace could not attach (ptrace not permitted?)"
        yield s
    finally:
        if s.poll() is None:
            s.terminate()
        try:
            s.wait(timeout=30)
        except subprocess.TimeoutExpired:
            s.kill()
            s.wait()


@contextlib.contextmanager
def private_tmpfs(d: Path, size: str = "400m") -> Iterator[Path]:
    """A tmpfs of its own mounted at ``d`` (made here; root): a memory tier a test can size
    and fill without touching /dev/shm or another test's slots. Unmounted (lazily) on the way
    out, whatever the test left in it."""
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


BLKIO = Path("/sys/fs/cgroup/blkio")


@contextlib.contextmanager
def throttled_disk(tmp_path: Path, mnt: Path, size_mb: int, write_bps: int) -> Iterator[Path]:
    """A real slow disk mounted at ``mnt`` (made here): ext4 on a loop device (a ``size_mb``
    MiB image in ``tmp_path``) whose writes are throttled to ``write_bps`` bytes/s for the
    processes of a blkio cgroup (v1; the writeback of an fsync is charged to the writer).
    Yields the cgroup's directory: write a pid to its ``cgroup.procs`` and that process's
    writes there are slow. Skips without root, losetup, mkfs.ext4 or the blkio controller.
    Everything is undone on the way out (processes left in the cgroup go back to the root)."""
    tools = [shutil.which(t) for t in ("losetup", "mkfs.ext4", "mount", "umount")]
    if os.geteuid() != 0 or None in tools or not (BLKIO / "cgroup.procs").exists():
        pytest.skip("needs root, losetup, mkfs.ext4 and the cgroup v1 blkio controller")
    image = tmp_path / f"{mnt.name}.img"
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    loop = subprocess.run(
        ["losetup", "--find", "--show", str(image)], capture_output=True, text=True, check=True
    ).stdout.strip()
    tag = hashlib.sha1(str(mnt).encode()).hexdigest()[:8]
    cg = BLKIO / f"trainguard-test-{os.getpid()}-{tag}"
    try:
        subprocess.run(["mkfs.ext4", "-q", loop], check=True, timeout=60)
        mnt.mkdir()
        subprocess.run(["mount", loop, str(mnt)], check=True, timeout=60)
        cg.mkdir()
        dev = os.stat(loop).st_rdev
        (cg / "blkio.throttle.write_bps_device").write_text(
            f"{os.major(dev)}:{os.minor(dev)} {write_bps}\n"
        )
        yield cg
    finally:
        if cg.exists():
            with contextlib.suppress(OSError):  # anything left in it goes back to the root
                for pid in (cg / "cgroup.procs").read_text().split():
                    (BLKIO / "cgroup.procs").write_text(pid)
            with contextlib.suppress(OSError):
                cg.rmdir()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=60)
        subprocess.run(["losetup", "-d", loop], capture_output=True, timeout=60)


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    """A private 400 MiB tmpfs for a ckptd's slots (``private_tmpfs``)."""
    with private_tmpfs(tmp_path / "shm") as d:
        yield d


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """Three hosts: network namespaces on a bridge of their own (root), removed after."""
    from trainguard.faults.netns import Hosts

    h = Hosts(3).up()
    try:
        yield h
    finally:
        h.down()
