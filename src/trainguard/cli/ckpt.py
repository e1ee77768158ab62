"""``trainguard ckpt ls|verify|export --run-dir DIR``: the checkpoints of a run, every tier.

- ``ls``      each step with the tiers holding it and their state: durable (verified or
              corrupt), partial (persisting or abandoned), and memory snapshots per rank
              (verified, unverified, torn) while the job's nodes still hold them
- ``verify``  re-checks every checksum (the archive's files are read back); exit status 1 if
              anything is corrupt
- ``export``  one durable step to a single ``torch.save`` file or to safetensors; a step only
              the archive (cold tier) holds is fetched from there first, verified

Steps in the cold tier (``archive_url``) are listed as tier ``archive``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

from rich.table import Table

from trainguard.checkpoint import snapshot, storage
from trainguard.observe.console import console


def _config(run_dir: Path) -> dict[str, Any]:
    from trainguard.controller.store import open_readonly, read_kv

    try:
        db = open_readonly(run_dir)
    except FileNotFoundError:
        return {}
    try:
        return read_kv(db, "config") or {}
    finally:
        db.close()


def _dirs(run_dir: Path) -> tuple[Path, Path, str]:
    cfg = _config(run_dir)
    root = Path(cfg.get("checkpoint_dir") or run_dir / "checkpoints")
    if not root.is_dir() and not (run_dir / "job.sqlite").exists():
        raise FileNotFoundError(
            f"{run_dir}: no checkpoints and no trainguard store here; pass the --run-dir of a job"
        )
    job = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return root, Path(cfg.get("shm_dir") or "/dev/shm"), job


def _archives(run_dir: Path) -> list[Any]:
    """The run's cold tier targets (``archive.Archive``), [] when it has none."""
    cfg = _config(run_dir)
    urls = cfg.get("archive_url") or []
    from trainguard.checkpoint.archive import Archive

    end = cfg.get("archive_endpoint_url")
    return [Archive(u, endpoint_url=end) for u in ([urls] if isinstance(urls, str) else urls)]


def _archive_rows(run_dir: Path, verify: bool) -> list[dict[str, Any]]:
    from trainguard.checkpoint.archive import ArchiveError

    rows = []
    for a in _archives(run_dir):
        row = {"tier": "archive", "where": a.url, "generation": None}
        try:
            steps = a.list_steps()
        except ArchiveError as e:
            rows.append({**row, "step": None, "state": "unreachable", "detail": [str(e)]})
            continue
        for step in steps:
            problems = a.verify(step) if verify else []
            state = "corrupt" if problems else ("verified" if verify else "uploaded")
            rows.append({**row, "step": step, "where": f"{a.url}/step_{step}", "state": state,
                         "detail": problems})  # fmt: skip
    return rows


def inventory(run_dir: Path, *, verify: bool) -> list[dict[str, Any]]:
    """Rows of (step, tier, where, state, detail), newest step first."""
    root, shm, job = _dirs(run_dir)
    rows: list[dict[str, Any]] = _archive_rows(run_dir, verify)
    for step in storage.list_committed(root):
        problems = storage.verify(root, step) if verify else []
        rows.append(
            {
                "step": step,
                "tier": "durable",
                "where": str(storage.step_dir(root, step)),
                "state": "corrupt" if problems else ("verified" if verify else "committed"),
                "generation": storage.committed_generation(root, step),
                "detail": problems,
            }
        )
    for tmp in sorted(root.glob(".tmp-step_*")) if root.is_dir() else []:
        m = storage.TMP_RE.match(tmp.name)
        if m:
            parts = sorted(p.parent.name for p in tmp.glob("rank_*/.done"))
            run = [f"run {m.group(3)}"] if m.group(3) else []
            rows.append(
                {
                    "step": int(m.group(1)),
                    "tier": "durable",
                    "where": str(tmp),
                    "state": "partial",
                    "generation": int(m.group(2)),
                    "detail": [*run, f"complete parts: {', '.join(parts) or 'none'}"],
                }
            )
    for path in sorted(shm.glob(f"trainguard-{job}-*-r*-s[0-9]")):
        h = snapshot.peek_header(path)
        if h is None:
            rows.append(
                {
                    "step": None,
                    "tier": "memory",
                    "where": str(path),
                    "state": "empty or torn",
                    "generation": None,
                    "detail": [],
                }
            )
            continue
        sums = snapshot.read_sums(path, h["step"], h["generation"])
        state = "unverified"
        if sums is not None:
            state = "staged"
            if verify:
                slot = snapshot.Slot(path, writable=False)
                try:
                    state = (
                        "verified"
                        if slot.checksums(h, snapshot.restore_threads()) == sums
                        else "corrupt"
                    )
                finally:
                    slot.close()
        rows.append(
            {
                "step": h["step"],
                "tier": "memory",
                "where": str(path),
                "state": state,
                "generation": h["generation"],
                "detail": [f"rank {h['rank']}"],
            }
        )
    return sorted(
        rows, key=lambda r: (-(r["step"] if r["step"] is not None else -1), r["tier"], r["where"])
    )


def export(run_dir: Path, step: int | None, out: Path, fmt: str) -> int:
    """Write durable ``step`` (default: the hot tier's newest verified, else the archive's
    newest) to ``out``. Raises ValueError naming the fix."""
    root, _, _ = _dirs(run_dir)
    with tempfile.TemporaryDirectory(prefix="trainguard-export-") as cold:
        step, root = _export_source(run_dir, root, step, Path(cold))
        _export_step(storage.step_dir(root, step), step, out, fmt)
    return step


def _export_source(run_dir: Path, root: Path, step: int | None, cold: Path) -> tuple[int, Path]:
    """(step, the directory holding it verified): the hot tier, else the archive's copy
    fetched into ``cold``. Raises ValueError naming the fix."""
    from trainguard.checkpoint.archive import ArchiveError

    hot = storage.newest_verified(root)[0] if step is None else step
    if hot is not None and hot in storage.list_committed(root) and not storage.verify(root, hot):
        return hot, root
    problems: list[str] = []
    for a in _archives(run_dir):
        try:
            archived = a.list_steps()
            want = archived[-1] if step is None and archived else step
            if want is not None and want in archived:
                a.fetch(want, cold)
                return want, cold
        except ArchiveError as e:
            problems.append(str(e))
    if problems:
        raise ValueError(problems[0])
    if step is None:
        raise ValueError(f"{root}: no verified durable checkpoint to export")
    problems = storage.verify(root, step) or [f"{storage.step_dir(root, step)}: not committed"]
    raise ValueError(f"step {step} is not a verified durable checkpoint: {problems[0]}")


def _export_step(src: Path, step: int, out: Path, fmt: str) -> None:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if fmt == "torch":
        dcp_to_torch_save(src, out)
        return
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ValueError(
            "--format safetensors needs the safetensors package: pip install safetensors"
        ) from None
    tmp = out.with_suffix(".tmp.pt")
    dcp_to_torch_save(src, tmp)
    sd = torch.load(tmp, weights_only=False)  # our own file, written just now
    tmp.unlink()
    flat: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        else:
            flat[prefix] = v

    walk("", sd)
    tensors = {k: v.contiguous() for k, v in flat.items() if isinstance(v, torch.Tensor)}
    meta = {
        k: json.dumps(v, default=str) for k, v in flat.items() if not isinstance(v, torch.Tensor)
    }
    save_file(tensors, str(out), metadata={"trainguard_step": str(step), **meta})


def main(args: argparse.Namespace) -> int:
    if args.action in ("ls", "verify"):
        rows = inventory(args.run_dir, verify=args.action == "verify")
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            t = Table(title=f"checkpoints of {args.run_dir}")
            for col in ("step", "gen", "tier", "state", "where", "detail"):
                t.add_column(col)
            for r in rows:
                t.add_row(
                    str(r["step"]),
                    str(r["generation"]),
                    r["tier"],
                    r["state"],
                    r["where"],
                    "; ".join(r["detail"])[:80],
                )
            console().print(t)
        return 1 if args.action == "verify" and any(r["state"] == "corrupt" for r in rows) else 0
    step = export(args.run_dir, args.step, args.out, args.format)
    print(f"exported step {step} to {args.out} ({args.format})")
    return 0
