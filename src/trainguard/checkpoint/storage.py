"""Durable tier: ``<root>/step_<N>/`` in plain torch.distributed.checkpoint layout.

A step is committed when its directory exists under its final name: writers fill
``<root>/.tmp-step_<N>-gen<G>-<run id>/`` (runid.py: two runs never share one), write
``manifest.json`` (size and CRC-32C of every file, the run and generation that wrote it) with
fsync, then rename the directory (atomic on POSIX) and fsync the root.
A directory without ``.metadata`` and ``manifest.json`` is never listed.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import crc32c

from trainguard.checkpoint import fingerprint
from trainguard.checkpoint.api import DCP_METADATA, MANIFEST
from trainguard.checkpoint.runid import RunIdentity, newer

_STEP_RE = re.compile(r"^step_(\d+)$")
_CHUNK = 8 << 20


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


# ``.tmp-step_<N>-gen<G>[-<run id>]``: a step being written (no run id: a prefetch or download)
TMP_RE = re.compile(r"^\.tmp-step_(\d+)-gen(\d+)(?:-([0-9A-Za-z]+))?$")


def tmp_dir(root: Path, step: int, generation: int, run_id: str = "") -> Path:
    """Where ``step`` of ``generation`` of run ``run_id`` is written before its commit."""
    return root / (f".tmp-step_{step}-gen{generation}" + (f"-{run_id}" if run_id else ""))


def list_committed(root: Path) -> list[int]:
    """Committed steps under ``root``, ascending. A missing root gives []."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        m = _STEP_RE.match(name)
        if m and (root / name / DCP_METADATA).is_file() and (root / name / MANIFEST).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


CHECKSUM = "crc32c"  # manifest field: CRC-32C (Castagnoli, RFC 3720) of the file, an int


def file_digest(path: Path) -> int:
    """CRC-32C of a file, read in 8 MiB chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = crc32c.crc32c(chunk, crc)
    return crc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sums(directory: Path, prefix: str = "") -> dict[str, dict[str, object]]:
    """Size and CRC-32C of every file below ``directory`` (fsynced first), keyed by relative path."""
    out: dict[str, dict[str, object]] = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            out[prefix + str(path.relative_to(directory))] = {
                "size": path.stat().st_size,
                CHECKSUM: file_digest(path),
            }
    return out


def commit(
    tmp: Path,
    root: Path,
    step: int,
    *,
    generation: int = 0,
    files: dict[str, dict[str, object]] | None = None,
    run: RunIdentity | None = None,
) -> Path:
    """Write the manifest (``files``, or checksums of everything in ``tmp``; the generation and
    run that wrote it), fsync, and atomically publish ``tmp`` as ``step_<step>``. Returns the
    final path.

    Raises FileExistsError if the step is already committed by a copy at least as new
    (``runid.newer``: this run's same or a newer generation, or a newer run) that verifies (that
    copy is kept); an older copy, or a corrupt one, is replaced.
    """
    if files is None:
        files = file_sums(tmp)
    manifest_tmp = tmp / (MANIFEST + ".tmp")
    with open(manifest_tmp, "w") as f:
        ident = run.to_json() if run is not None else {}
        json.dump({"step": step, "generation": generation, **ident, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(manifest_tmp, tmp / MANIFEST)
    _fsync_dir(tmp)
    final = step_dir(root, step)
    if final.exists():
        old_run = committed_run(root, step)
        if newer(old_run, committed_generation(root, step), run, generation) and not verify(
            root, step
        ):
            # this generation's copy, or a newer one's (a late part of an abandoned timeline,
            # e.g. re-persisted by a restarted ckptd, never replaces the newer one)
            raise FileExistsError(f"checkpoint step {step} already committed at {final}")
        # A copy of another generation (a run that resumed from before it: its timeline was
        # abandoned) or one that fails verification: the new, complete copy replaces it. Both
        # swap names in one atomic exchange where the filesystem has it, so a kill leaves the
        # old or the new step_N, never neither; the old copy, now under ``tmp``'s name, is
        # deleted after (a kill first leaves it to ``prune`` or ``clean_leftovers``).
        if _exchange(tmp, final):
            _fsync_dir(root)
            shutil.rmtree(tmp, ignore_errors=True)
            return final
        # Elsewhere (no RENAME_EXCHANGE: NFS, some FUSE) the old one moves aside first, so some
        # complete step_N exists at every moment but one rename apart (``clean_leftovers``
        # renames it back at a re-run), and is deleted only after the new one is in place.
        aside = root / f".replaced-step_{step}-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(final, aside)
        os.rename(tmp, final)
        _fsync_dir(root)
        shutil.rmtree(aside, ignore_errors=True)
        return final
    os.rename(tmp, final)
    _fsync_dir(root)
    return final


_RENAME_EXCHANGE = 2  # renameat2(2) flag: swap the two names atomically (Linux 3.15+)
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names of ``a`` and ``b`` in one atomic step (``renameat2`` with
    RENAME_EXCHANGE). False, with nothing changed, where the C library or the filesystem does
    not have it; other OSErrors propagate."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def committed_generation(root: Path, step: int) -> int:
    """The generation that wrote a committed step (from its manifest; 0 if unrecorded)."""
    try:
        return int(json.loads((step_dir(root, step) / MANIFEST).read_text()).get("generation", 0))
    except (OSError, ValueError):
        return 0


def committed_run(root: Path, step: int) -> RunIdentity | None:
    """The run that wrote a committed step (from its manifest; None if unrecorded)."""
    try:
        d = json.loads((step_dir(root, step) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return RunIdentity.from_json(d) if isinstance(d, dict) else None


def verify(root: Path, step: int) -> list[str]:
    """Check every file of a committed step against its manifest. Returns the problems found ([] = ok)."""
    problems, files = _manifest(root, step)
    if problems:
        return problems
    d = step_dir(root, step)
    for name, want in files.items():
        path = d / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != want["size"]:
            problems.append(f"{path}: size {path.stat().st_size} != {want['size']}")
        elif file_digest(path) != want[CHECKSUM]:
            problems.append(f"{path}: checksum mismatch")
    return problems


def step_bytes(root: Path, step: int) -> int:
    """Bytes of a committed step's files, from its manifest (0 if unreadable)."""
    return sum(int(w["size"]) for w in _manifest(root, step)[1].values())


def verify_for_load(root: Path, step: int) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """What a restore checks before it reads a step (``reader.VerifyingReader`` checks the
    data files' checksums as it reads them): the manifest, every file present with its size,
    and the DCP metadata's checksum. Returns (problems, the manifest's files)."""
    problems, files = _manifest(root, step)
    if problems:
        return problems, {}
    d = step_dir(root, step)
    for name, want in files.items():
        path = d / name
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{path}: missing")
            continue
        if size != want["size"]:
            problems.append(f"{path}: size {size} != {want['size']}")
        elif name == DCP_METADATA and file_digest(path) != want[CHECKSUM]:
            problems.append(f"{path}: checksum mismatch")
    return problems, files


def _manifest(root: Path, step: int) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """A committed step's manifest files (name → size, crc32c), or the problem with it."""
    d = step_dir(root, step)
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return [f"{d / MANIFEST}: unreadable ({e})"], {}
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(files, dict)
        or not files
        or not all(
            isinstance(w, dict)
            and isinstance(w.get("size"), int)
            and isinstance(w.get(CHECKSUM), int)
            for w in files.values()
        )
    ):
        return [
            f"{d / MANIFEST}: not a trainguard manifest (files with size and crc32c expected)"
        ], {}
    if DCP_METADATA not in files:
        return [f"{d / MANIFEST}: does not cover {DCP_METADATA}"], {}
    return [], files


def newest_verified(
    root: Path, *, at_most: int | None = None
) -> tuple[int | None, dict[int, list[str]]]:
    """Newest committed step whose files verify (<= ``at_most`` if given), and the corrupt ones skipped."""
    skipped: dict[int, list[str]] = {}
    for step in reversed(list_committed(root)):
        if at_most is not None and step > at_most:
            continue
        problems = verify(root, step)
        if not problems:
            return step, skipped
        skipped[step] = problems
    return None, skipped


def prune(
    root: Path,
    keep: int,
    *,
    committed_step: int | None = None,
    generation: int | None = None,
    run_id: str | None = None,
    removed: list[str] | None = None,
) -> list[int]:
    """Delete committed steps beyond the newest ``keep``, and abandoned temp directories:
    those of steps not newer than ``committed_step``, of generations older than ``generation``,
    or written by a run other than ``run_id`` (a dead run's leftovers: never merged, removed);
    their names are appended to ``removed``.

    The newest committed step is never deleted (``keep`` >= 1 is enforced), and an older
    step is deleted only after a newer one is committed. Nor is the newest step before the
    first whose ranks' fingerprints differ (``fingerprint.durable_verdict``): a silent data
    corruption's rollback target outlives the steps written after it. Returns the
    deleted steps.
    """
    keep = max(1, keep)
    steps = list_committed(root)
    doomed = steps[:-keep] if len(steps) > keep else []
    if doomed:
        held = _sdc_hold(root, steps)
        doomed = [st for st in doomed if st != held]
    for step in doomed:
        # Out of the listing in one rename, then deleted: a kill mid-delete leaves a temp
        # directory that the next prune (or a re-run's ``clean_leftovers``) removes, never a
        # half-removed ``step_N`` that nothing lists and so nothing ever deletes.
        aside = root / f".tmp-step_{step}-gen{committed_generation(root, step)}-pruned"
        shutil.rmtree(aside, ignore_errors=True)
        try:
            os.rename(step_dir(root, step), aside)
        except OSError:
            aside = step_dir(root, step)
        shutil.rmtree(aside, ignore_errors=True)
    for path in root.glob(".tmp-step_*"):
        m = TMP_RE.match(path.name)
        if m is None:
            continue
        stale_step = committed_step is not None and int(m.group(1)) <= committed_step
        stale_gen = generation is not None and int(m.group(2)) < generation
        other_run = run_id is not None and m.group(3) is not None and m.group(3) != run_id
        if stale_step or stale_gen or other_run:
            shutil.rmtree(path, ignore_errors=True)
            if removed is not None:
                removed.append(path.name)
    return doomed


SDC_HOLD = ".sdc-hold"


def _sdc_hold(root: Path, steps: list[int]) -> int | None:
    """The step retention must keep for a silent data corruption's rollback: the newest step
    before the first one whose ranks differ (a step with nothing to compare counts as good).
    Steps after the first differing one may agree again, a flipped low bit rounded away, and
    still be corrupt. The hold is recorded in ``root/.sdc-hold`` (step, generation, and the
    differing step's generation): it outlives the deletion of the differing steps themselves
    (the newest ``keep`` move past them), and ends once a later generation than the differing
    step's committed a step (the job rolled back and went on)."""
    path = root / SDC_HOLD
    try:
        hold: dict[str, int] | None = json.loads(path.read_text())
    except (OSError, ValueError):
        hold = None
    verdicts = [(st, fingerprint.durable_verdict(step_dir(root, st))) for st in steps]
    bad = next((st for st, ok in verdicts if ok is False), None)
    if bad is not None:
        good = max((st for st, ok in verdicts if ok is not False and st < bad), default=None)
        if good is not None and (hold is None or hold["step"] != good):
            hold = {"step": good, "generation": committed_generation(root, good),
                    "bad_generation": committed_generation(root, bad)}  # fmt: skip
            tmp = path.with_name(SDC_HOLD + ".tmp")
            tmp.write_text(json.dumps(hold))
            os.replace(tmp, path)
    if hold is None:
        return None
    gens = {committed_generation(root, st) for st in steps}
    if any(g > hold["bad_generation"] for g in gens) and bad is None:
        path.unlink(missing_ok=True)  # a later generation committed cleanly: rolled back
        return None
    held = int(hold["step"])
    return (
        held if held in steps and committed_generation(root, held) == hold["generation"] else None
    )


def clean_leftovers(root: Path) -> dict[str, list[str]]:
    """Make a durable tier left by a dead run safe to write into again; call it before any
    writer of the new run starts (``trainguard run`` does, once, at its start).

    - ``.tmp-step_*`` (a step being written when the run died, never committed) is removed;
    - ``.replaced-step_N-*`` (``commit`` died between its two renames) is renamed back to
      ``step_N`` when no ``step_N`` exists and it verifies, else removed.

    Returns ``{"removed": [...], "restored": [...]}`` (directory names). A missing root is
    clean. OSErrors other than a vanished entry propagate (the run dir is unusable)."""
    out: dict[str, list[str]] = {"removed": [], "restored": []}
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return out
    for name in names:
        path = root / name
        m = re.match(r"^\.replaced-step_(\d+)-", name)
        if m is not None and not step_dir(root, int(m.group(1))).exists():
            step = int(m.group(1))
            os.rename(path, step_dir(root, step))
            if not verify(root, step):
                out["restored"].append(name)
                continue
            os.rename(step_dir(root, step), path)  # not a whole copy: remove it below
        if name.startswith((".tmp-step_", ".replaced-step_")):
            shutil.rmtree(path, ignore_errors=True)
            out["removed"].append(name)
    if out["removed"] or out["restored"]:
        _fsync_dir(root)
    return out
