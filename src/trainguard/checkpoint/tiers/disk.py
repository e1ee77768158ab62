"""The local disk tier: the durable DCP directory (``storage.py``), read with each file checked
against the step's manifest as it is read. The last tier a rank reads: when it cannot restore
the point either, the rank raises its error and the controller picks an older point."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar

from trainguard.checkpoint import storage
from trainguard.checkpoint.api import (
    PER_RANK_KEY,
    PER_SHARD_KEY,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    rank_world,
    say,
)
from trainguard.checkpoint.tiers.api import Failure, Held, Index, Point, Tier

AGAIN = "the controller restarts from an older checkpoint"


class DiskTier(Tier):
    name: ClassVar[str] = "durable"

    @staticmethod
    def holds(index: Index) -> Held:
        """Every committed durable point, for every rank (DCP reshards across world changes)."""
        return Held(every_rank=frozenset(index.durable))

    @property
    def where(self) -> str:
        return f"the durable tier ({self.side.root})"

    def restore(self, state: dict[str, Any], point: Point) -> bool:
        rk, step = self.side, point[0]
        # The manifest, sizes and metadata now; each data file's checksum as it is read.
        problems, sums = storage.verify_for_load(rk.root, step)
        if problems:
            if not storage.step_dir(rk.root, step).exists():
                err: CheckpointError = CheckpointNotFoundError(
                    f"step {step} is in no tier of rank {rk.rank} (memory or {rk.root}); {AGAIN}"
                )
            else:
                err = CheckpointCorruptError(f"step {step}: {'; '.join(problems)}; {AGAIN}")
                # the controller verifies this copy again before it plans it (server.py)
                rk.emit("ckpt_corrupt", step=step, tier="durable", problems=problems[:4])
            self.failure = Failure(err, problems)
            return False
        try:  # whole tensors straight into the live ones, no read buffer copied out
            read_step(state, rk.rank, rk.root, step, sums, emit=rk.emit, direct=True)
        except CheckpointCorruptError as e:
            rk.emit("ckpt_corrupt", step=step, tier="durable", problems=[str(e)])
            self.failure = Failure(CheckpointCorruptError(f"step {step}: {e}; {AGAIN}"), [str(e)])
            return False
        except CheckpointReadError as e:
            self.failure = Failure(e, [str(e)])
            return False
        return True


def read_step(
    state: dict[str, Any],
    rank: int,
    root: Path,
    step: int,
    sums: dict[str, dict[str, Any]] | None = None,
    *,
    emit: Any,
    direct: bool = False,
    checksums: bool = True,
) -> None:
    """Read this rank's keys of durable ``step`` of ``root`` into ``state``. ``sums``: the
    step's manifest files: each file read is checked against them as it is read (one pass,
    ``reader.VerifyingReader``); None: the step was verified whole already. Raises
    CheckpointCorruptError for a file that does not match (``state`` may then hold some
    of its values: do not go on with it), CheckpointReadError when a file cannot be read
    (permissions, I/O error, vanished), CheckpointError when the saved keys do not fit
    the live state. ``direct``: whole tensors are read straight into the live ones
    (``VerifyingReader``); ``checksums=False``: it was checked whole just before (sizes
    are still checked)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from trainguard.checkpoint import state as state_mod
    from trainguard.checkpoint.reader import CorruptFileError, VerifyingReader

    path = storage.step_dir(root, step)
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except OSError as e:
        raise CheckpointReadError(f"step {step} of {root}: {e}") from e
    conv = state_mod.converted(state, rank)
    _account_per_rank(conv, md.state_dict_metadata, rank, step, emit)
    _fill_missing(conv, md, step, emit)
    # no_dist: each rank reads its own keys (DTensor targets: the chunks overlapping its
    # shard); a collective here would deadlock against ranks that restore from memory.
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(
                conv,
                checkpoint_id=str(path),
                storage_reader=VerifyingReader(path, sums, direct=direct, checksums=checksums)
                if sums is not None
                else None,
                planner=state_mod.TypedLoadPlanner(),
                no_dist=True,
            )
    except CorruptFileError as e:
        raise CheckpointCorruptError(str(e)) from None
    except OSError as e:
        raise CheckpointReadError(f"step {step} of {root}: {e}") from e
    except CheckpointException as e:  # a BaseException: would escape `except Exception`
        raise _load_error(e, step, root) from None
    state_mod.apply(state, conv, rank)


def _fill_missing(conv: dict[str, Any], md: Any, step: int, emit: Any) -> None:
    """Create the keys the live state does not have yet from the saved ones' metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainguard.checkpoint import state as state_mod

    live, _ = state_mod.flatten_typed(conv)
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    saved = {
        k: (
            (m.properties.dtype, tuple(m.size), tuple(paths.get(k, ())))
            if isinstance(m, TensorStorageMetadata)
            else (None, (), tuple(paths.get(k, ())))
        )
        for k, m in md.state_dict_metadata.items()
    }
    filled = state_mod.fill_missing(conv, live, saved)
    state_mod.replace_overlapping(conv)
    if filled:
        emit("ckpt_keys_created", step=step, tier="durable", count=len(filled))


def _load_error(e: Any, step: int, root: Path) -> CheckpointError:
    """The error DCP's CheckpointException stands for: a corrupt or unreadable file, or a
    saved state that does not fit the live one."""
    from trainguard.checkpoint.reader import CorruptFileError

    failures = getattr(e, "failures", {}) or {}
    read = [f[0] for f in failures.values() if isinstance(f, tuple) and isinstance(f[0], OSError)]
    corrupt = [x for x in read if isinstance(x, CorruptFileError)]
    if corrupt:
        return CheckpointCorruptError(str(corrupt[0]))
    if read:
        return CheckpointReadError(f"step {step} of {root}: {read[0]}")
    first = next((ln for ln in str(e).splitlines() if "Error" in ln), str(e)[:300])
    return CheckpointError(
        f"step {step} of {root} does not fit this state ({first.strip()}); "
        "the script's state must have the keys it had when it saved"
    )


def _account_per_rank(conv: dict[str, Any], saved_md: Any, rank: int, step: int, emit: Any) -> None:
    """Per-rank and per-shard state across a world change (elastic), never silent:

    - a key of this rank's (``per_rank.<rank>``, ``per_shard.<id>``) that the step does
      not hold starts fresh (the world grew, or a shard no one ran): event
      ``ckpt_per_rank_absent`` / ``ckpt_per_shard_absent``;
    - rank 0 reports the ``per_rank`` state of ranks beyond the world that it drops (the
      world shrank: their RNG states cannot be merged): ``ckpt_per_rank_dropped``, and a
      stderr line. ``per_shard`` state is never dropped: every shard goes to the rank
      that runs it now.
    """
    saved_ranks: set[int] = set()
    for k in saved_md:
        head, _, rest = k.partition(".")
        if head == PER_RANK_KEY and rest.split(".", 1)[0].isdigit():
            saved_ranks.add(int(rest.split(".", 1)[0]))

    def held(key: str) -> bool:
        return any(k == key or k.startswith(key + ".") for k in saved_md)

    for key in [k for k in conv if k.startswith((PER_RANK_KEY + ".", PER_SHARD_KEY + "."))]:
        if not held(key):
            del conv[key]
            if key.startswith(PER_RANK_KEY + "."):
                emit("ckpt_per_rank_absent", step=step, rank=rank)
            else:
                emit("ckpt_per_shard_absent", step=step, shard=key.split(".", 1)[1])
    _, world = rank_world()
    dropped = sorted(r for r in saved_ranks if r >= world)
    if rank == 0 and dropped:
        emit("ckpt_per_rank_dropped", step=step, ranks=dropped, world=world)
        say(
            f"step {step} was saved by {max(saved_ranks) + 1} ranks, this world has {world}: "
            f"the per_rank state of ranks {', '.join(map(str, dropped))} is dropped (keep "
            f"what must follow the data in state['{PER_SHARD_KEY}'] instead)"
        )
