"""Replica groups: local recovery, where the groups that are live keep training while a failed
group restarts and heals from a live peer (``trainguard run --replica-groups G``).

The job's W ranks form G groups of S = W/G consecutive ranks; a group lies within one node.
Each group is a whole model replica: inside it, DDP or FSDP2 over the group's own process
group (``init_process_group``: ``RANK``/``WORLD_SIZE`` of torch are the group's); across the
groups, the ranks of the same *slot* (rank within the group) average their gradients over a
gloo process group of the groups that are live — the replicate dimension of HSDP, made
elastic as torchft's ``Manager`` makes it. The script's side::

    from trainguard import replica
    replica.init_process_group("gloo")                # this group's ranks only
    model = DDP(Net()) if replica.group_size() > 1 else Net()
    opt = torch.optim.AdamW(model.parameters())
    rg = replica.ReplicaGroup(model, opt)             # joins; a returning group heals here
    while rg.step < steps:                            # rg.step: steps done
        x, y = batch(rg.step + 1)                     # the data position is the step
        loss_fn(model(x), y).backward()
        rg.step_optimizer()                           # average across live groups, step

**Quorum** (``runtime/quorum.py``): decided by the groups, on the agents' view of process
deaths, through the ledger in the generation's TCPStore; not by the controller, whose view
comes a heartbeat later: a survivor's pending all-reduce fails within milliseconds of a kill,
and the dead rank's agent writes the next epoch (its group out) as soon as ``waitpid`` says
so. Each step's all-reduce carries, besides the gradients, one flag per member: "I see a newer
epoch"; the sum is the same on every member, so all of them move to the next epoch at the
same step boundary. A failed all-reduce moves every survivor to the next epoch too (epochs are
walked one at a time, so all take the same one). When no agent writes that epoch within
``EVICT_GRACE_S`` (nothing died: a partition between groups, a hung member), the members that
reach the store report themselves alive and write it without the others (``quorum.evict``).
The ranks of one group (S > 1) take each of these decisions together (``_agree``): every slot
applies a step or none does.

**Heal**: on entering an epoch the members all-gather their steps; those behind the newest
(a returning group: step -1) receive, slot by slot, the model, optimizer and RNG state and
the step from the first member at the newest step, over that epoch's process group, in
chunks of ``CHUNK_BYTES`` each checked by its xxh3-64 digest; nothing is applied until every
chunk verified, so no group ever steps with a mixed state. The receiving group then trains
the step the others train. No live peer: ``ReplicaError``, the agent falls back to global
recovery.

Events (the report's accounting): ``quorum_epoch`` (slot 0 of each group: epoch, members,
the step from which they train together), ``group_healed`` (the receiver: source group,
bytes, seconds), ``group_step_failed`` (a step whose all-reduce failed: the step retried).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from trainguard.runtime import api, quorum
from trainguard.runtime.core import init
from trainguard.runtime.inprocess import Connection, comm_error, cut_only, tcp_connections

ENV_GROUPS = api.ENV_REPLICA_GROUPS
ENV_INCARNATION = api.ENV_REPLICA_INCARNATION
ENV_TIMEOUT_S = api.ENV_REPLICA_TIMEOUT_S
# A drill (tests, docs/local_recovery.md): "die-sending:N" / "die-receiving:N", this process
# SIGKILLs itself after the N-th heal chunk it sent / received; once per run directory.
ENV_DRILL = "TRAINGUARD_REPLICA_DRILL"
CHUNK_BYTES = 8 << 20  # bytes of state one heal message carries (a digest each)
DEFAULT_TIMEOUT_S = 30.0
# After a failed collective, how long the survivors wait for the dead rank's agent to write
# the next epoch (it does within its 0.1 s loop of the death) before they write it without
# the members that did not report alive: a member alive and reachable reports within
# milliseconds of its own failure, and a partition's two sides fail within one gloo
# timeout of each other, so 2 s covers a loaded machine; one left out wrongly restarts and
# rejoins (consistent, only slower).
EVICT_GRACE_S = 2.0


class ReplicaError(RuntimeError):
    """This group cannot go on with the others: it was left out of the quorum, no live peer
    holds the state, or a healed state failed its check. The process exits; its agent falls
    back to restarting it or, past the budget, to global recovery."""


def groups() -> int:
    """G: the number of replica groups of the job (1 without ``--replica-groups``)."""
    return int(os.environ.get(ENV_GROUPS, "1") or 1)


def _job_rank() -> tuple[int, int]:
    return int(os.environ.get("TRAINGUARD_JOB_RANK", os.environ.get("RANK", "0"))), int(
        os.environ.get("TRAINGUARD_JOB_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    )


def group_size() -> int:
    """S = W/G: the ranks of one replica group."""
    return _job_rank()[1] // groups()


def group() -> int:
    """This rank's replica group, 0..G-1 (ranks g·S … g·S+S-1)."""
    return _job_rank()[0] // group_size()


def slot() -> int:
    """This rank's place within its group, 0..S-1 (the ``RANK`` of the group's process group)."""
    return _job_rank()[0] % group_size()


def _timeout_s() -> float:
    return float(os.environ.get(ENV_TIMEOUT_S, DEFAULT_TIMEOUT_S))


def _store() -> quorum.BoundedStore:
    return quorum.connect(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), _timeout_s())


def init_process_group(backend: str = "gloo", **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` for this replica group only: rank ``slot()``
    of ``group_size()``, rendezvous under the group's and incarnation's prefix in the
    generation's store. Without replica groups (G = 1): the plain call (env://)."""
    if groups() <= 1:
        dist.init_process_group(backend, **kwargs)
        return
    inc = os.environ.get(ENV_INCARNATION, "0")
    raw = quorum.connect_raw(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             _timeout_s())  # fmt: skip
    store = dist.PrefixStore(f"{quorum.PREFIX}/group{group()}/inc{inc}", raw)
    kwargs.setdefault("timeout", datetime.timedelta(seconds=max(_timeout_s(), 60.0)))
    dist.init_process_group(backend, store=store, rank=slot(), world_size=group_size(), **kwargs)


def _drill(what: str, n: int) -> None:
    """SIGKILL this process if the drill names ``what`` at chunk ``n`` and has not fired."""
    spec = os.environ.get(ENV_DRILL, "")
    if spec != f"{what}:{n}":
        return
    marker = os.path.join(os.environ.get(api.ENV_RUN_DIR) or ".", ".replica-drill-fired")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def _digest(t: torch.Tensor) -> int:
    """xxh3-64 of ``t``'s bytes, as a signed int64 (a tensor element)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return int.from_bytes(xxhash.xxh3_64_digest(raw), "little", signed=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "to_local", None)  # a DTensor: this rank's shard (same on every group)
    return full() if full is not None else t


def _pieces(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t``'s bytes in pieces of at most ``CHUNK_BYTES`` (none for an empty tensor)."""
    if not t.numel():
        return
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), CHUNK_BYTES):
        yield flat[start : start + CHUNK_BYTES]


class ReplicaGroup:
    """This rank's side of local recovery (module docstring): the gradient average across live
    groups, the quorum epochs, and healing from a peer.

    ``model``: the group's module (plain, DDP or FSDP2); ``optimizer`` its optimizer, whose
    parameters must all receive gradients every step; ``extra``: further objects with
    ``state_dict``/``load_state_dict`` whose state is JSON (an LR scheduler), healed with them;
    ``step``: the steps done when this process starts (a checkpoint's; a returning group heals
    to the others' anyway). Constructing it joins the quorum, and heals when the others are ahead.
    Raises ``ReplicaError`` (above), ``quorum.QuorumError`` (no store within the deadline).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        extra: Mapping[str, Any] | None = None,
        step: int = 0,
    ) -> None:
        self.model, self.optimizer, self.extra = model, optimizer, dict(extra or {})
        self.step = step
        self.groups, self.group, self.slot = groups(), group(), slot()
        self.rt = init()
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._pg: Any = None
        self._pg_conns: set[Connection] = set()
        self.members: tuple[int, ...] = ()
        self._width: int | None = None  # members of the last step (before an epoch after it)
        self.epoch = -1
        if self.groups <= 1:
            return
        # The group's own ranks decide together (a gloo group of them: any default backend):
        # whether a step's cross-group all-reduce succeeded, whether to move to the next
        # epoch, whether an epoch formed. Each slot sees its own collective: without this, one
        # slot could apply a step that another slot of the same group retries (``_agree``).
        self._inner: Any = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._inner = dist.new_group(backend="gloo")
        self._store = _store()
        cur = quorum.ensure(self._store, self.groups)
        if os.environ.get(ENV_INCARNATION, "0") != "0":  # a returning group: in, and behind
            self.step = -1
            cur = quorum.join(self._store, self.group, f"group {self.group} is back")
            self._enter(cur)
        else:
            # A generation's ranks start together but not at once (a slower restore, a cold
            # start): epoch 0 forms once every group is up, or the deadline passed (then its
            # process group fails to form and the ones that came go on without the others).
            with self.rt.phase("replica quorum"):
                quorum.report_started(self._store, self.group)
                quorum.wait_started(self._store, self.groups, self._deadline(3.0))
            self._enter(quorum.read(self._store, 0) or cur)

    # ------------------------------------------------------------ the step
    @property
    def width(self) -> int:
        """How many groups took part in the last step (an epoch entered after it can differ)."""
        if self.groups <= 1:
            return 1
        return self._width if self._width is not None else len(self.members)

    def step_optimizer(self, *, loss: float | None = None) -> float | None:
        """Average the gradients across the live groups, ``optimizer.step()``, zero them, and
        count the step (``self.step``: steps done). After a heal ``self.step`` may have moved
        past the step this rank computed: its gradients were stale and are dropped (no
        optimizer step here; the state came from the peer). Returns the mean of ``loss`` over
        the groups that took part (float64 sum / width), or None. Raises ``ReplicaError``,
        ``quorum.QuorumError``."""
        if self.groups <= 1:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            return loss
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        flat = torch.cat([_local(g).reshape(-1) for g in grads])
        while True:
            n = len(self.members)
            newer = quorum.read(self._store, self.epoch + 1) is not None
            meta = torch.tensor([loss or 0.0, float(newer), 1.0], dtype=torch.float64)
            buf = flat / n  # as DDP: each contribution scaled, then summed
            failed: Exception | None = None
            try:
                # a wait bounded by the process group's timeout, not a hang (a partitioned
                # peer is found out at that timeout, before the hang detector's floor)
                with self.rt.phase("replica all-reduce"):
                    self._pg.allreduce([meta]).wait()
                    self._pg.allreduce([buf]).wait()
            except Exception as e:  # a member died mid-step (or its link): the next epoch
                if not comm_error(e):
                    raise
                failed = e
            # every slot of this group applies the step, or none does; the "newer epoch" sum
            # is each slot's own (the same in every group), so its max is the same everywhere
            bad, moved = self._agree([float(failed is not None),
                                      0.0 if failed else float(meta[1].item())])  # fmt: skip
            if bad:
                first = str(failed).strip().splitlines() if failed else []
                why = (first[0][:200] if first else type(failed).__name__) if failed else (
                    "another slot of this group failed its all-reduce")  # fmt: skip
                self._event("group_step_failed", step=self.step + 1, epoch=self.epoch,
                            reason=why)  # fmt: skip
                self._drop(cut=True)
                before = self.step
                self._enter(self._after_failure(self.epoch, self._deadline()))
                if self.step != before:  # healed past this step: these gradients are stale
                    return None
                continue
            if int(meta[2].item()) != n:
                raise ReplicaError(f"epoch {self.epoch}: {int(meta[2])} of {n} members summed")
            self._width = n
            break
        off = 0
        for p, g in zip(self._params, grads, strict=True):
            loc = _local(g)
            k = loc.numel()
            if p.grad is None:
                p.grad = g
            _local(p.grad).copy_(buf[off : off + k].view_as(loc))
            off += k
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if moved > 0:  # a member saw the next epoch: every member moves, here
            self._enter(quorum.wait_after(self._store, self.epoch, self._deadline()))
        return float(meta[0].item()) / n if loss is not None else None

    def finish(self, timeout_s: float | None = None) -> None:
        """At the end of training: while a group is out of the quorum (restarting), wait for it
        to join, at most ``timeout_s`` seconds (default: the quorum timeout), and heal it to
        this final state, so that every rank ends at the same step with the same state.
        Raises ``ReplicaError`` as ``step_optimizer``."""
        if self.groups <= 1:
            return
        deadline = time.monotonic() + (_timeout_s() if timeout_s is None else timeout_s)
        while True:  # the group's slots decide each round together (one enters, all do)
            nxt = quorum.read(self._store, self.epoch + 1)
            done = len(self.members) == self.groups or time.monotonic() >= deadline
            go, stop = self._agree([float(nxt is not None), float(done)])
            if go:
                self._enter(nxt or quorum.wait_after(self._store, self.epoch, self._deadline()))
            elif stop:
                return
            else:
                time.sleep(0.01)

    # ------------------------------------------------------------ epochs
    def _deadline(self, factor: float = 1.0) -> float:
        return time.monotonic() + factor * _timeout_s()

    def _enter(self, rec: quorum.Epoch) -> None:
        """Make epoch ``rec`` this rank's: its process group, then the members' steps agreed
        (heal the ones behind). An epoch whose process group cannot form or whose agreement
        fails (a member died in it too) is left for the next one while the deadline allows.
        Raises ``ReplicaError`` when an epoch leaves this group out."""
        with self.rt.phase("replica quorum"):  # a long wait here is not a hang: deadlines
            self._enter_epochs(rec)

    def _enter_epochs(self, rec: quorum.Epoch) -> None:
        deadline = time.monotonic() + 3 * _timeout_s()
        while True:
            if self.group not in rec.members:
                raise ReplicaError(
                    f"group {self.group} is not in quorum epoch {rec.epoch} ({rec.why}): it was "
                    "declared failed; its agent restarts it"
                )
            self.epoch, self.members = rec.epoch, rec.members
            err: Exception | None = None
            try:
                self._pg = self._connect(rec)
                self._sync()
            except ReplicaError:
                raise
            except Exception as e:  # gloo's connect or a collective: a member is gone
                err = e
            if not self._agree([float(err is not None)])[0]:  # every slot of the group in
                return
            self._drop(cut=True)
            if time.monotonic() >= deadline:
                why = err or "another slot of this group could not enter it"
                raise ReplicaError(f"quorum epoch {rec.epoch} did not form: {why}") from err
            rec = self._after_failure(rec.epoch, deadline)

    def _agree(self, flags: list[float]) -> list[float]:
        """The max of ``flags`` over this group's ranks (one float64 all-reduce on their own
        gloo group; as they are when the group has one rank)."""
        if self._inner is None:
            return flags
        t = torch.tensor(flags, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._inner)
        return [float(x) for x in t.tolist()]

    def _after_failure(self, epoch: int, deadline: float) -> quorum.Epoch:
        """The epoch after ``epoch``, whose collective failed here: the one a dead rank's agent
        writes or, none within ``EVICT_GRACE_S``, the one of the members that report alive
        (module docstring). Raises ``quorum.QuorumError`` at ``deadline``, RuntimeError when
        the store does not answer (this side is the one cut off)."""
        quorum.report_alive(self._store, epoch, self.group)
        grace = min(time.monotonic() + EVICT_GRACE_S, deadline)
        with contextlib.suppress(quorum.QuorumError):
            return quorum.wait_after(self._store, epoch, grace)
        keep = quorum.alive(self._store, epoch, self.members)
        gone = [m for m in self.members if m not in keep]
        why = f"group(s) {gone} unreachable" if gone else "a failed collective, every group up"
        return quorum.evict(self._store, epoch, keep, why)

    def _connect(self, rec: quorum.Epoch) -> Any:
        store = dist.PrefixStore(f"{quorum.PREFIX}/pg{rec.epoch}/slot{self.slot}", self._store.raw)
        self._drop()
        before = tcp_connections()
        pg = quorum.bounded(
            lambda: dist.ProcessGroupGloo(
                store,
                rec.members.index(self.group),
                len(rec.members),
                datetime.timedelta(seconds=_timeout_s()),
            ),
            2 * _timeout_s(),  # gloo's own connect deadline is one timeout
            f"quorum epoch {rec.epoch}'s process group",
        )
        self._pg_conns = tcp_connections() - before  # gloo's full mesh, made just now
        return pg

    def _drop(self, *, cut: bool = False) -> None:
        """Let go of this epoch's process group; ``cut``: after a failure, shut its sockets
        first, so that a member still blocked in a collective of it (a ring's neighbour of
        the dead one) fails at once instead of at gloo's timeout."""
        if cut and self._pg_conns:
            cut_only(self._pg_conns)
        self._pg, self._pg_conns = None, set()

    def _sync(self) -> None:
        """The members' steps: the ones behind the newest receive the state from the first
        member at it (``_send`` / ``_recv``); then every member is at that step."""
        mine = torch.tensor([self.step], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in self.members]
        self._pg.allgather([out], [mine]).wait()
        steps = [int(t.item()) for t in out]
        top = max(steps)
        if top < 0:
            why = (f"quorum epoch {self.epoch}: no member holds a trained state (every group is "
                   "new): global recovery restores from the checkpoint")  # fmt: skip
            quorum.mark_state_lost(self._store, why)
            raise ReplicaError(why)
        src = steps.index(top)
        me = self.members.index(self.group)
        behind = [i for i, s in enumerate(steps) if s < top]
        if me == src:
            for dst in behind:
                self._send(dst)
        elif me in behind:
            self._recv(src, top)
        if behind:  # every member sees the heal through, or none does (the source died
            # mid-send): then all of them take the next epoch, and heal from another member
            self._pg.allreduce([torch.ones(1)]).wait()
        if self.slot == 0:
            self._event("quorum_epoch", epoch=self.epoch, members=list(self.members),
                        groups=self.groups, group_size=group_size(),
                        step=top, healed=[self.members[i] for i in behind])  # fmt: skip

    # ------------------------------------------------------------ state
    def _state(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """The tensors of the state in a fixed order (live ones: model parameters and buffers,
        optimizer state, the CPU RNG) and its JSON part (hyper-parameters, extras, step)."""
        tensors = [(f"model/{k}", _local(v)) for k, v in self.model.state_dict().items()]
        osd = self.optimizer.state_dict()
        plain: dict[str, Any] = {}
        for pid in sorted(osd["state"]):
            for name, v in sorted(osd["state"][pid].items()):
                if isinstance(v, torch.Tensor):
                    tensors.append((f"optim/{pid}/{name}", _local(v)))
                else:
                    plain[f"{pid}/{name}"] = v
        tensors.append(("rng/cpu", torch.get_rng_state()))
        groups_ = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
        extra = {k: o.state_dict() for k, o in self.extra.items()}
        meta = {"param_groups": groups_, "plain": plain, "extra": extra, "step": self.step}
        return tensors, meta

    def _send(self, dst: int) -> None:
        tensors, meta = self._state()
        sig = [(n, list(t.shape), str(t.dtype)) for n, t in tensors]
        digests = [_digest(p) for _, t in tensors for p in _pieces(t)]
        head = json.dumps({**meta, "sig": sig}).encode()
        self._pg.send([torch.tensor([len(head), len(digests)], dtype=torch.int64)], dst, 1).wait()
        self._pg.send([torch.frombuffer(bytearray(head), dtype=torch.uint8)], dst, 2).wait()
        self._pg.send([torch.tensor(digests, dtype=torch.int64)], dst, 3).wait()
        sent = 0
        for _, t in tensors:
            for piece in _pieces(t):
                self._pg.send([piece.contiguous()], dst, 4).wait()
                sent += 1
                _drill("die-sending", sent)

    def _recv(self, src: int, top: int) -> None:
        t0 = time.monotonic()
        sizes = torch.zeros(2, dtype=torch.int64)
        self._pg.recv([sizes], src, 1).wait()
        raw = torch.zeros(int(sizes[0]), dtype=torch.uint8)
        self._pg.recv([raw], src, 2).wait()
        meta = json.loads(raw.numpy().tobytes())
        self.optimizer.zero_grad(set_to_none=True)  # this rank's gradients are stale now
        tensors, _ = self._state()
        if any(n.startswith("optim/") for n, _, _ in meta["sig"]) and not self.optimizer.state:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            get_state_dict(self.model, self.optimizer)  # makes the lazily created state
            tensors, _ = self._state()
        mine = [[n, list(t.shape), str(t.dtype)] for n, t in tensors]
        if meta["sig"] != mine:
            bad = next((a, b) for a, b in zip(meta["sig"], mine, strict=False) if a != b)
            raise ReplicaError(f"the peer's state is laid out differently: {bad[0]} vs {bad[1]}")
        digests = torch.zeros(int(sizes[1]), dtype=torch.int64)
        self._pg.recv([digests], src, 3).wait()
        staged: list[torch.Tensor] = []
        nbytes, i = 0, 0
        for _, t in tensors:
            for piece in _pieces(t):
                buf = torch.empty_like(piece)
                self._pg.recv([buf], src, 4).wait()
                if _digest(buf) != int(digests[i]):
                    raise ReplicaError(f"heal chunk {i} from group {self.members[src]} is corrupt")
                staged.append(buf)
                nbytes, i = nbytes + buf.numel(), i + 1
                _drill("die-receiving", i)
        # every chunk checked: apply (nothing before this line touched the live state)
        it = iter(staged)
        with torch.no_grad():
            for name, t in tensors:
                parts = [next(it) for _ in range(-(-t.numel() * t.element_size() // CHUNK_BYTES))]
                if parts:
                    t.copy_(torch.cat(parts).view(t.dtype).view(t.shape))
                if name == "rng/cpu":
                    torch.set_rng_state(t)
        for g, hyper in zip(self.optimizer.param_groups, meta["param_groups"], strict=True):
            g.update(hyper)
        for key_, v in meta["plain"].items():
            pid, name = key_.split("/", 1)
            self.optimizer.state[self._params[int(pid)]][name] = v
        for k, o in self.extra.items():
            o.load_state_dict(meta["extra"][k])
        self.step = top
        self._event("group_healed", epoch=self.epoch, source_group=self.members[src], step=top,
                    bytes=nbytes, chunks=i, seconds=round(time.monotonic() - t0, 4))  # fmt: skip

    def _event(self, kind: str, **data: Any) -> None:
        with contextlib.suppress(Exception):
            self.rt.event_now(kind, group=self.group, slot=self.slot, **data)

    def state_digest(self) -> str:
        """xxh3-64 over this rank's model and optimizer state (hex): equal on every group's
        same slot when their states are equal (the benchmark's ``state_equal_after_heal``)."""
        h = xxhash.xxh3_64()
        for name, t in self._state()[0]:
            if name != "rng/cpu":
                h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
