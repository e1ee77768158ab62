"""The one-pass durable reader (issue 16): a part written by the persister reads back through
``VerifyingReader`` exactly as ``dcp.load`` reads it, checking each file's CRC-32C against the
manifest over the same bytes; a flipped byte, a truncated file, or a file the manifest does
not list raise ``CorruptFileError``."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainguard.checkpoint.dcp_part import write_part
from trainguard.checkpoint.reader import CHUNK, CorruptFileError, VerifyingReader


def _part(tmp_path: Path) -> tuple[Path, dict, dict]:
    g = torch.Generator().manual_seed(0)
    state = {
        "big": torch.randn(CHUNK // 4 * 2 + 5, generator=g),  # several requests in flight
        "small": torch.arange(7, dtype=torch.int64),
        "half": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "odd": torch.arange(3, dtype=torch.int8),  # puts the next record at an odd offset
        "after": torch.randn(5, 3, generator=g),
        "strided": torch.randn(4, 6, generator=g).t(),  # not row-major: torch.load reads it
        "scalar": torch.tensor(2.5),
        "view": torch.randn(600_000, generator=g)[100_000:500_000],  # of a larger storage
    }
    sums = write_part(tmp_path / "p", state, {}, {})
    return tmp_path / "p", {k.removeprefix("p/"): v for k, v in sums.items()}, state


def _load(path: Path, sums: dict, like: dict, direct: bool = False, checksums: bool = True) -> dict:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    reader = VerifyingReader(path, sums, direct=direct, checksums=checksums)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=reader, no_dist=True)
    assert reader.bytes_read > 0
    return out


@pytest.mark.parametrize(
    ("direct", "checksums"),
    [(False, True), (True, True), (False, False), (True, False)],
    ids=["read", "direct", "read-unchecked", "direct-unchecked"],
)
def test_a_part_reads_back_bit_for_bit_as_dcp_reads_it(
    tmp_path: Path, direct: bool, checksums: bool
) -> None:
    """Read whole (preads in flight) or direct (a prefetched copy: whole tensors read straight
    into the live ones), with checksums or without (a copy checked whole just before): records
    at any offset, of any dtype, strided or 0-dim, come back bit for bit."""
    path, sums, state = _part(tmp_path)
    got = _load(path, sums, state, direct, checksums)
    plain = {k: torch.zeros_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(plain, checkpoint_id=str(path), no_dist=True)  # plain DCP reads it too
    for k, v in state.items():
        assert torch.equal(got[k], v) and torch.equal(plain[k], v), k


def _raises_corrupt(path: Path, sums: dict, like: dict, match: str, direct: bool) -> None:
    with pytest.raises(BaseException) as info:  # DCP wraps it in a CheckpointException
        _load(path, sums, like, direct)
    seen = [info.value, *getattr(info.value, "failures", {}).values()]
    flat = [x[0] if isinstance(x, tuple) else x for x in seen]
    assert any(isinstance(x, CorruptFileError) and match in str(x) for x in flat), flat


@pytest.mark.parametrize("direct", [False, True], ids=["read", "direct"])
def test_a_flipped_byte_a_short_file_and_an_unlisted_file_are_corrupt(
    tmp_path: Path, direct: bool
) -> None:
    path, sums, state = _part(tmp_path)
    data = next(p for p in path.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    _raises_corrupt(path, sums, state, "checksum mismatch", direct)
    data.write_bytes(bytes(raw[:-10]))
    _raises_corrupt(path, sums, state, "size", direct)
    _raises_corrupt(path, {k: v for k, v in sums.items() if not k.endswith(".distcp")}, state,
                    "not in the step's manifest", direct)  # fmt: skip


@pytest.mark.parametrize("zip_crc", [True, False])
def test_a_record_is_read_in_place_whatever_its_layout(zip_crc: bool) -> None:
    """``saved_tensor_view`` finds the storage bytes of a ``torch.save`` record (with or
    without the zip's CRC-32, as trainguard writes them) for views, transposes and bf16, and
    gives up (None, torch.load then reads it) on what is not a plain tensor."""
    import io
    import pickle

    from trainguard.checkpoint.dcp_part import _no_zip_crc32
    from trainguard.checkpoint.reader import saved_tensor_view

    def record(obj: object) -> torch.Tensor:
        b = io.BytesIO()
        if zip_crc:
            torch.save(obj, b)
        else:
            with _no_zip_crc32():
                torch.save(obj, b)
        return torch.frombuffer(bytearray(b.getvalue()), dtype=torch.uint8)

    for t in (
        torch.arange(10, dtype=torch.float32),
        torch.randn(3, 4).t(),  # strides of a transpose
        torch.randn(5).to(torch.bfloat16),
        torch.arange(12).view(3, 4)[1:],  # a view: the whole storage saved, with an offset
    ):
        got = saved_tensor_view(record(t))
        assert got is not None and torch.equal(got, t) and got.stride() == t.stride(), t
    assert saved_tensor_view(record({"a": 1})) is None
    assert (
        saved_tensor_view(torch.frombuffer(bytearray(pickle.dumps(1)), dtype=torch.uint8)) is None
    )


@pytest.mark.parametrize("checksums", [True, False], ids=["checked", "unchecked"])
def test_direct_items_whose_ends_are_read_ahead_come_back_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checksums: bool
) -> None:
    """Direct mode requests the two ends of the next ``AHEAD`` items before their bodies;
    with a window of one item and of all of them, every item comes back bit for bit and a
    file cut short is still an error."""
    import trainguard.checkpoint.reader as reader_mod

    path, sums, state = _part(tmp_path)
    for ahead in (1, 16):
        monkeypatch.setattr(reader_mod, "AHEAD", ahead)
        got = _load(path, sums, state, True, checksums)
        for k, v in state.items():
            assert torch.equal(got[k], v), (ahead, k)
    # cut short, with a manifest that agrees (so only the reads in flight can find it)
    data = next(path.rglob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    rel = str(data.relative_to(path))
    sums = {**sums, rel: {**sums[rel], "size": data.stat().st_size}}
    with pytest.raises(BaseException) as info:  # DCP wraps it in a CheckpointException
        _load(path, sums, state, True, checksums)
    seen = [info.value, *getattr(info.value, "failures", {}).values()]
    flat = [x[0] if isinstance(x, tuple) else x for x in seen]
    assert any(isinstance(x, CorruptFileError) and "ended at byte" in str(x) for x in flat), flat
