"""Device → pinned → slot staging: the logic runs here with ``SyncBackend`` standing in for a
CUDA stream; the CUDA path itself runs only where a GPU is present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainguard.checkpoint import device, snapshot, state


class RecordingBackend(device.SyncBackend):
    """Synchronous copies that record the order of operations."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def begin(self) -> None:
        self.log.append("begin")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(f"copy{tuple(src.shape)}")
        super().copy(dst, src)

    def record(self) -> device.Event:
        self.log.append("record")
        return super().record()


def test_stager_copies_each_group_then_records_its_event(tmp_path: Path) -> None:
    srcs = [
        torch.arange(6.0).reshape(2, 3).t(),
        torch.ones(4, dtype=torch.bfloat16),
        torch.zeros(2),
    ]
    backend = RecordingBackend()
    stager = device.Stager({0: srcs[0], 1: srcs[1]}, backend)
    events = stager.start(srcs, [[1], [0]])
    assert len(events) == 2
    assert backend.log == ["begin", "copy(4,)", "record", "copy(3, 2)", "record"]
    for i in (0, 1):  # contiguous host buffers with the source's values
        assert stager.buffers[i].is_contiguous() and torch.equal(stager.buffers[i], srcs[i])
    srcs[0].add_(1)  # the source changes after staging: the buffer keeps the staged values
    assert torch.equal(stager.buffers[0], torch.arange(6.0).reshape(2, 3).t())

    # pinned → slot: what the checkpointer's background thread writes
    layout = snapshot.Layout.plan({str(i): t for i, t in enumerate(srcs)}, 64)
    path = tmp_path / "slot"
    snapshot.create_slot(path, layout.total_bytes)
    slot = snapshot.Slot(path, writable=True)
    host = [stager.buffers[0], stager.buffers[1], srcs[2]]
    slot.write_tensors(layout, host)
    slot.commit(layout, state.pack_objects({}), {"step": 1, "generation": 0})
    h = slot.header()
    assert h is not None
    views, _ = slot.views(h)
    assert torch.equal(views["0"], torch.arange(6.0).reshape(2, 3).t())
    assert torch.equal(views["1"], srcs[1])
    slot.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stager_side_stream_and_pinned_buffers() -> None:  # pragma: no cover - GPU only
    t = torch.randn(1 << 20, device="cuda")
    stager = device.Stager({0: t}, device.backend_for(t.device))
    assert stager.buffers[0].is_pinned()
    (ev,) = stager.start([t], [[0]])
    stager.hold(ev)  # the current stream waits; the host does not
    t.mul_(2)  # queued after the copy on the current stream
    ev.synchronize()
    assert torch.equal(stager.buffers[0].cuda() * 2, t)
