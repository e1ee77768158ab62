"""The cold tier's chunk codec: every mode round-trips any length, damage is refused, and the
chooser compresses only when its measurements say it pays against the link."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from trainguard.checkpoint import codec
from trainguard.checkpoint.codec import Chooser, Mode


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("n", [0, 1, 3, 4097, 1 << 20])
def test_every_mode_round_trips_any_length(mode: Mode, n: int) -> None:
    raw = os.urandom(n)
    stored = codec.encode(raw, mode)
    assert stored[4] == mode and codec.decode(stored) == raw


def test_shuffle_helps_float_state_and_damage_is_refused() -> None:
    raw = torch.randn(1 << 20).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    plain = len(codec.encode(raw, Mode.ZSTD))
    shuffled = len(codec.encode(raw, Mode.ZSTD_SHUF2))
    assert shuffled < plain < len(raw)
    stored = bytearray(codec.encode(raw, Mode.ZSTD_SHUF2))
    stored[len(stored) // 2] ^= 0xFF
    with contextlib.suppress(ValueError):  # a frame that no longer decodes is refused outright
        assert codec.address(codec.decode(bytes(stored))) != codec.address(raw)
    with pytest.raises(ValueError, match="not a trainguard chunk"):
        codec.decode(b"XXXX\x00abc")


def test_the_chooser_compresses_only_where_it_pays() -> None:
    sample = {Mode.ZSTD: (0.9, 500e6), Mode.ZSTD_SHUF4: (0.8, 400e6)}
    assert Chooser(link_bps=None, sample=sample).choose() == Mode.RAW  # link not measured yet
    assert Chooser(link_bps=5e9, sample=sample, threads=1).choose() == Mode.RAW  # fast link
    assert Chooser(link_bps=20e6, sample=sample, threads=1).choose() == Mode.ZSTD_SHUF4  # slow
    assert Chooser(policy="off", link_bps=1e6, sample=sample).choose() == Mode.RAW
    assert Chooser(policy="zstd+shuf2").choose() == Mode.ZSTD_SHUF2
    c = Chooser()
    c.measure([torch.randn(1 << 18).numpy().tobytes()])
    assert set(c.sample) == {Mode.ZSTD, Mode.ZSTD_SHUF4, Mode.ZSTD_SHUF2}
    assert all(0 < r < 1.1 and s > 0 for r, s in c.sample.values())
