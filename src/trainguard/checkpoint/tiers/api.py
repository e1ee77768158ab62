"""What every checkpoint tier is: one protocol, asked on both sides of a restart.

- **The controller** asks ``holds(index)``: which restore points the tier can serve to which
  ranks, from the agents' reports (``Index``: a plain copy of what they said, so that this
  package never imports the controller). ``None``: the controller does not track the tier
  (its copies are copies of another tier's steps, or it fills another tier).
- **A restarting rank** asks ``restore(state, point)``: True when the tier put that point,
  verified, into ``state``; False when it holds no verified copy (an event says why when one
  was there but failed), so the next tier is tried. A tier that could not restore may leave a
  ``failure``: the error the rank raises if no later tier restores the point either.

A tier is one file of this package and one entry of ``TIERS`` (``tiers/__init__.py``), the
order, fastest first, that both sides read. Rank-side code imports torch inside its
functions: the controller reads the registry without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from trainguard.checkpoint.api import CheckpointError

if TYPE_CHECKING:
    from trainguard.checkpoint.backend import CkptdBackend, LocalBackend

Point = tuple[int, int]  # (step, generation that wrote it)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NodeIndex:
    """What one node's agent last reported of the copies it holds."""

    healthy: bool  # running or standby: its copies may be read
    memory: Mapping[int, Any] = dataclasses.field(default_factory=dict)  # rank → [(step, gen)]
    replicas: Mapping[int, Any] = dataclasses.field(default_factory=dict)  # peer rank → points
    replica_addr: str | None = None  # host:port of its ckptd's replica server


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Index:
    """The controller's view of every tier, at one decision."""

    ranks: Mapping[int, str]  # rank of the assignment → the node that runs it
    nodes: Mapping[str, NodeIndex]  # every node that reports, by name
    durable: tuple[Point, ...] = ()  # committed durable points
    memory: bool = True  # memory snapshots serve this restart (the world did not change)
    replicas: bool = False  # nodes keep replicas of their peers' snapshots


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Held:
    """The points a tier can serve: to each rank (``per_rank``) or to every rank alike."""

    per_rank: Mapping[int, set[Point]] = dataclasses.field(default_factory=dict)
    every_rank: frozenset[Point] = frozenset()

    def serves(self, rank: int, point: Point) -> bool:
        return point in self.every_rank or point in self.per_rank.get(rank, ())


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankSide:
    """What a tier reads this rank's copies with; built by ``Checkpointer.load``."""

    rank: int
    generation: int  # the restarting generation (ckptd verifies a slot once per generation)
    root: Path  # the durable tier's root
    memory: bool  # memory snapshots may be read (memory tier on, and the world unchanged)
    backend: Callable[[], LocalBackend | CkptdBackend]  # the node's ckptd, or this process's
    emit: Callable[..., None]  # a runtime event: ``emit(kind, **fields)``
    env: Mapping[str, str]  # the worker's environment (where the agent says copies are)


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """Why a tier could not restore a point, for when no later tier can either."""

    error: CheckpointError  # raised by the rank
    problems: list[str]  # told to the controller (``ckpt_restore_failed``)


class Tier(Protocol):
    """One checkpoint tier (see the module docstring). ``name`` labels its events and its
    count in a generation's ``restore_tiers``; after a ``restore`` that returned True,
    ``where`` says it for the user's stderr line and ``details`` are extra fields of the
    ``ckpt_load_end`` event."""

    name: ClassVar[str]
    side: RankSide
    details: dict[str, Any]
    failure: Failure | None

    def __init__(self, side: RankSide) -> None:
        self.side = side
        self.details = {}
        self.failure = None

    @staticmethod
    def holds(index: Index) -> Held | None:
        """The points this tier can serve to which ranks (None: the controller does not
        track it). Pure: the controller asks it while it decides."""
        ...

    @property
    def where(self) -> str:
        return f"the {self.name} tier"

    def restore(self, state: dict[str, Any], point: Point) -> bool:
        """Put ``point`` into ``state`` from a verified copy: True; False when this tier has
        none (then ``failure``, if set, is what the rank raises should no later tier restore
        it). Raises CheckpointError only when the saved state cannot fit the live one."""
        ...


def per_rank(index: Index, points: Callable[[int, str], set[Point]]) -> Held:
    """A ``Held`` of ``points(rank, node)`` for each rank of the assignment."""
    return Held(per_rank={r: points(r, n) for r, n in index.ranks.items()})
