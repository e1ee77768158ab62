"""The memory tier's DCP metadata: a rank's chunk plus boxes tiling the rest of the tensor."""

from __future__ import annotations

import itertools

import pytest

from trainguard.dcp.reader import _complement


def _cells(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[tuple[int, ...]]:
    return [
        cell
        for off, size in boxes
        for cell in itertools.product(*(range(o, o + s) for o, s in zip(off, size, strict=True)))
    ]


@pytest.mark.parametrize(
    ("size", "offset", "shape"),
    [
        ((16, 4), (0, 0), (8, 4)),  # FSDP's first dim-0 shard
        ((16, 4), (8, 0), (8, 4)),
        ((6, 6), (2, 2), (2, 2)),  # a tile in the middle (2-D parallelism)
        ((5, 3, 4), (1, 0, 2), (2, 3, 1)),
        ((7,), (7,), (0,)),  # an empty last shard: the complement is the whole tensor
        ((4, 4), (0, 0), (4, 4)),  # the whole tensor: nothing else
        ((), (), ()),
    ],
)
def test_the_complement_tiles_the_rest_of_the_tensor_exactly(
    size: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...]
) -> None:
    boxes = _complement(size, offset, shape)
    cells = _cells(boxes)
    assert len(cells) == len(set(cells))  # disjoint
    mine = set(_cells([(offset, shape)])) if all(shape) else set()
    whole = set(itertools.product(*(range(n) for n in size))) if size else set()
    assert set(cells) == whole - mine  # exactly the rest
