"""An alert's log line and a recovery's are read by people: values, not Python reprs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from trainguard.controller.eventlog import record_decided
from trainguard.controller.monitor import Monitor
from trainguard.controller.store import Store
from trainguard.protocol import FaultCause


def test_an_alert_logs_key_value_pairs_not_a_dict_repr(caplog: pytest.LogCaptureFixture) -> None:
    m = Monitor()
    with caplog.at_level(logging.WARNING, logger="trainguard.monitor"):
        m.alert("hang_localized", {"cause": FaultCause.HANG, "rank": 1, "z": 11.23456,
                                   "steps": [5, 9]})  # fmt: skip
    line = caplog.records[-1].getMessage()
    assert line == "alert hang_localized: cause=hang rank=1 z=11.23 steps=[5,9]"
    assert m.alerts[-1]["cause"] is FaultCause.HANG  # the kept alert is unchanged


def test_a_recovery_logs_its_phases_in_seconds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="trainguard.controller"):
            record_decided(store, Monitor(), "recovery_completed", {"generation": 1,
                           "durations_s": {"detect": 0.0291, "stop": 0.24, "clean": None,
                                           "total": 3.82}})  # fmt: skip
    finally:
        store.close()
    lines = [r.getMessage() for r in caplog.records if "recovered" in r.getMessage()]
    assert lines == ["[gen 1] recovered in 3.82s (detect 0.029s, stop 0.240s)"]
