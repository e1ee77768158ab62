"""Snapshots of accelerator tensors: device → pinned host staging → shared memory.

A slot lives in host memory, so a GPU tensor crosses the bus first. ``Stager`` owns one
pinned host buffer per device entry of a layout (allocated once, reused every save) and
copies into them on a side CUDA stream that first waits for the current stream (so it sees
the values as of ``save()``), then records an event per group of entries:

- entries the next forward may change (buffers: BatchNorm statistics, EMA weights,
  counters) — the current stream waits for their event before it runs anything else, so
  the next forward's kernels queue behind the copy; the host never blocks;
- entries only the optimizer writes (parameters, optimizer state) — the current stream
  waits for their event in the optimizer's step pre-hook, i.e. only where the next
  optimizer step would overwrite the source.

The host side (pinned → slot, a memcpy) runs on the checkpointer's background thread
after ``event.synchronize()``. Without CUDA the same logic runs with ``SyncBackend``
(synchronous copies, events already complete): any other device, and the CPU tests.
Restores go the other way in ``snapshot.restore`` (pread into a pinned buffer, then a
non-blocking host → device copy).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Event(Protocol):
    def synchronize(self) -> None: ...


class Backend(Protocol):
    """Where copies run: a side stream and its events (CUDA), or synchronously."""

    def begin(self) -> None:
        """Order the copies after the work already queued on the current stream."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def record(self) -> Event:
        """An event that completes when every copy issued so far is done."""
        ...

    def hold(self, event: Event) -> None:
        """Make the current stream wait for ``event`` (the host does not block)."""

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer for ``like``'s bytes (contiguous, same shape and dtype)."""
        ...


class _Done:
    def synchronize(self) -> None:
        return None


class SyncBackend:
    """Copies at once on the calling thread (devices without streams; tests)."""

    def begin(self) -> None:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> Event:
        return _Done()

    def hold(self, event: Event) -> None:
        return None

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype)


class CudaBackend:
    """A side stream on ``device``; pinned host buffers; non-blocking device → host copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.stream)  # the allocator must not reuse src before the copy

    def record(self) -> Event:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def hold(self, event: Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)


def backend_for(device: torch.device) -> Backend:
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaBackend(device)
    return SyncBackend()


class Stager:
    """Pinned staging for the device entries of one layout.

    Args:
        entries: layout index → a tensor of that entry (shape and dtype give the buffer).
        backend: where the copies run (``backend_for(device)`` normally).
    """

    def __init__(self, entries: dict[int, torch.Tensor], backend: Backend) -> None:
        self.backend = backend
        self.buffers = {i: backend.pinned(t) for i, t in entries.items()}

    def start(self, srcs: list[torch.Tensor], groups: list[list[int]]) -> list[Event]:
        """Queue the copies of ``srcs[i]`` (layout order) for each group of indices; one
        event per group, in order."""
        self.backend.begin()
        events = []
        for group in groups:
            for i in group:
                self.backend.copy(self.buffers[i], srcs[i].detach())
            events.append(self.backend.record())
        return events

    def hold(self, event: Event) -> None:
        self.backend.hold(event)

    def host(self, indices: list[int]) -> list[torch.Tensor]:
        return [self.buffers[i] for i in indices]
