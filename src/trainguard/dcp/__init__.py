"""trainguard's checkpoint tiers behind ``torch.distributed.checkpoint`` (DCP).

A script (or a framework: torchtitan, Megatron's DCP path) that saves with DCP keeps its calls
and names a trainguard storage writer and reader::

    import torch.distributed.checkpoint as dcp
    import trainguard.dcp

    step0 = trainguard.dcp.resume_step()           # the agreed step, None: a fresh start
    if step0 is not None:
        dcp.load(state, storage_reader=trainguard.dcp.Reader())
    ...
    dcp.async_save(state, storage_writer=trainguard.dcp.Writer(step),
                   process_group=ckpt_group)         # or dcp.save(...): the same snapshot

**Save.** Each rank's state (all of it: its shards and its copy of the replicated tensors and
values, before DCP's de-duplication) is copied into a snapshot slot in shared memory, the
same slots, header and checksums as ``Checkpointer.save``: under ``trainguard run`` the
node's ckptd owns them (they outlive a crashed worker), replicates them to peer nodes and
persists them. With ``dcp.async_save`` the writer is DCP's ``AsyncStager``: the copy is the
whole stall (``stage``); DCP's planning runs in its background thread, whose ``write_data``
publishes the snapshot with the entries DCP's plan has this rank write
(``api.DCP_WRITES``). The persister then writes exactly those, so the durable step
(``<root>/step_<N>``) is the DCP checkpoint ``dcp.save`` would have written: plain
``dcp.load(state, checkpoint_id=<root>/step_<N>)`` reads it.

**Load.** ``Reader`` serves the agreed step (``$TRAINGUARD_RESTORE_STEP`` under ``trainguard
run``; else the step named, else the newest this process or the durable root holds) from the
fastest tier with a verified copy: this rank's snapshot in memory (a peer's replica pulled
into a local slot first, for a replaced node's ranks), else the durable step, each file
checked against its manifest as it is read: this node's prefetched copy of it when a standby
holds that point (a file that fails there is read from the durable root), else the durable
root. The memory tier serves a rank whose live shards
are the ones it saved (same world, same parallelism); any other read (a resharded state, a
corrupt snapshot found while copying) is re-planned against the durable step's metadata. A
restore that no tier can serve emits ``ckpt_restore_failed`` (the controller then picks an
older point) and raises ``CheckpointNotFoundError`` / ``CheckpointCorruptError``.

The cold tier (object storage) reaches the reader as it reaches the ``Checkpointer``: when the
disk tier lacks the archive's newest verified step (a new machine, a wiped disk), the
controller rebuilds that step in the disk tier before the first generation, and the reader
reads it as the durable step. Lazily created optimizer state is DCP's business: build the
state with ``torch.distributed.checkpoint.state_dict.get_state_dict``.

Concurrency: a ``dcp.async_save`` runs DCP's collectives on a background thread; give it a
process group of its own (``dist.new_group(backend="gloo")``), as torchtitan does, so they
never interleave with the training's collectives. One writer's save at a time: ``stage``
waits (``STAGE_WAIT_S``) for the previous background save to publish its snapshot.
"""

from __future__ import annotations

from trainguard.dcp.common import checkpointer, resume_step
from trainguard.dcp.reader import Reader
from trainguard.dcp.writer import STAGE_WAIT_S, Writer

__all__ = ["STAGE_WAIT_S", "Reader", "Writer", "checkpointer", "resume_step"]
