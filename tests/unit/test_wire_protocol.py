"""The report protocol's validation and the timing rule that scales with the job."""

from __future__ import annotations

import pytest

from trainguard.controller.api import scaled_timing
from trainguard.protocol import PROTOCOL_VERSION, ProtocolError, validate_report

GOOD = {
    "v": PROTOCOL_VERSION,
    "node_id": "node0",
    "addr": "127.0.0.2",
    "incarnation": "abc",
    "generation": 3,
    "workers": [{"rank": 0, "local_rank": 0, "pid": 1, "state": "running", "step": 9}],
    "memory": {"0": [[8, 3], [9, 3]]},
    "steps": [{"generation": 3, "rank": 0, "items": [{"step": 9}]}],
    "store": [3, 29500],
}


def test_a_well_formed_report_passes_and_unknown_fields_are_allowed() -> None:
    validate_report(GOOD)
    validate_report({**GOOD, "something_newer": {"x": 1}})


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"node_id": 7}, "node_id"),
        ({"addr": "x" * 300}, "addr"),
        ({"generation": "3"}, "generation"),
        ({"workers": {"rank": 0}}, "workers: a list"),
        ({"workers": [{"rank": "0", "state": "running"}]}, "workers[].rank"),
        ({"memory": {"zero": [[1, 0]]}}, "rank 'zero'"),
        ({"memory": {"0": [[1, True]]}}, "memory[0]"),
        ({"steps": [{"generation": 1}]}, "steps[]"),
        ({"v": 0}, "v:"),
        ({"v": PROTOCOL_VERSION + 1}, "upgrade the controller"),
        ({"store": 5}, "store"),
    ],
)
def test_a_malformed_field_is_named(change: dict[str, object], says: str) -> None:
    with pytest.raises(ProtocolError, match=None) as e:
        validate_report({**GOOD, **change})
    assert says in str(e.value), str(e.value)


def test_the_heartbeat_scales_with_the_node_count() -> None:
    assert scaled_timing(4) == (0.5, 10.0)
    assert scaled_timing(4096) == (4.096, 20.48)
    hb, timeout = scaled_timing(16384)
    assert hb == 16.384 and timeout == 5 * hb  # five missed heartbeats
