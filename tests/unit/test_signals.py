"""Failure prediction's sources and rules (issue 15): the kernel log (GPU Xid errors, block
I/O errors), SMART reports, GPU throttling and temperature trends, read from a directory of
files a test writes (``TRAINGUARD_SIGNALS_ROOT``), then judged by ``RiskWatch``; a standby
flagged at risk is quarantined, not used as a replacement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.test_sdc import cfg, running
from trainguard.controller.api import Phase, Pool
from trainguard.controller.decide import decide
from trainguard.controller.jobstate import Inputs
from trainguard.controller.risk import RiskConfig, RiskWatch
from trainguard.health.signals import CRITICAL_XIDS, SignalReader

XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
XID_13 = "NVRM: Xid (PCI:0000:3b:00): 13, pid=1234, Graphics Exception: ESR 0x404600"
IO = "blk_update_request: I/O error, dev nvme0n1, sector 123456 op 0x1:(WRITE)"


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TRAINGUARD_SIGNALS_ROOT", str(tmp_path / "{node}"))
    (tmp_path / "n1/dev").mkdir(parents=True)
    return tmp_path / "n1"


def _log(root: Path, *lines: str) -> None:
    with open(root / "dev/kmsg", "a") as f:
        f.writelines(line + "\n" for line in lines)


def test_the_kernel_log_counts_xids_and_io_errors_from_where_it_left_off(root: Path) -> None:
    reader = SignalReader("n1")
    assert reader.read() == {}  # no log file yet: no source
    _log(root, "usb 1-1: new device", XID_13)
    got = reader.read()
    assert got == {"gpu_xid": 1.0, "gpu_xid_critical": 0.0, "io_errors": 0.0, "gpu_xid_last": 13.0}
    _log(root, XID_79, IO, IO)
    got = reader.read()
    assert (got["gpu_xid"], got["gpu_xid_critical"], got["io_errors"]) == (2.0, 1.0, 2.0)
    assert got["gpu_xid_last"] == 79.0 and 79 in CRITICAL_XIDS and 13 not in CRITICAL_XIDS
    with open(root / "dev/kmsg", "a") as f:
        f.write(IO)  # a line still being written: counted once it ends
    assert reader.read()["io_errors"] == 2.0
    _log(root, "")
    assert reader.read()["io_errors"] == 3.0
    reader.close()


def test_smart_reports_of_every_disk_are_summed(root: Path) -> None:
    (root / "smart").mkdir()
    ata = {"smart_status": {"passed": True},
           "ata_smart_attributes": {"table": [{"id": 5, "raw": {"value": 8}},
                                              {"id": 197, "raw": {"value": 2}},
                                              {"id": 9, "raw": {"value": 40000}}]}}  # fmt: skip
    nvme = {"smart_status": {"passed": False},
            "nvme_smart_health_information_log": {"media_errors": 3, "critical_warning": 4}}  # fmt: skip
    (root / "smart/sda.json").write_text(json.dumps(ata))
    (root / "smart/nvme0.json").write_text(json.dumps(nvme))
    (root / "smart/broken.json").write_text("{")  # a torn report: skipped
    got = SignalReader("n1").read()
    assert got == {"smart_failed": 1.0, "smart_reallocated": 8.0, "smart_pending": 2.0,
                   "smart_media_errors": 3.0, "smart_critical_warning": 1.0}  # fmt: skip


def test_sudden_signs_each_flag_a_node_once() -> None:
    w = RiskWatch(RiskConfig())
    base = {"gpu_xid_critical": 0, "io_errors": 0, "smart_pending": 2, "gpu_throttled": 0}
    assert w.observe("n", 0.0, base) is None
    assert (
        w.observe("n", 1.0, {**base, "gpu_xid_critical": 1}) == "gpu_xid_critical rose from 0 to 1"
    )
    assert w.observe("n", 2.0, {**base, "gpu_xid_critical": 1}) is None  # flagged once
    why = w.observe("n", 3.0, {**base, "gpu_xid_critical": 1, "io_errors": 4})
    assert why == "io_errors rose from 0 to 4"
    now = {**base, "gpu_xid_critical": 1, "io_errors": 4}
    assert w.observe("n", 4.0, {**now, "smart_pending": 3}) == "smart_pending rose from 2 to 3"
    assert w.observe("n", 5.0, {**now, "smart_pending": 3, "gpu_throttled": 1}) is not None


def test_a_temperature_climb_is_flagged_before_the_threshold_and_a_warm_plateau_is_not() -> None:
    w = RiskWatch(RiskConfig(temp_margin_c=5, temp_horizon_s=600, window_s=600))
    limit = {"gpu_temp_slowdown_c": 90.0}
    # 60 °C → 75 °C over 5 minutes (3 °C/min): 15 °C left, reached in about 5 minutes.
    flagged = [w.observe("g", t * 10.0, {"gpu_temp_c": 60 + t * 0.5, **limit}) for t in range(31)]
    hit = [i for i, why in enumerate(flagged) if why is not None]
    assert hit and flagged[hit[0]] is not None and "climbing" in flagged[hit[0]], flagged
    assert 60 + hit[0] * 0.5 < 75  # well before the margin rule would fire (85 °C)
    flat = RiskWatch(RiskConfig(temp_horizon_s=600, window_s=600))
    warm = [flat.observe("g", t * 10.0, {"gpu_temp_c": 80 + (t % 2), **limit}) for t in range(60)]
    assert warm == [None] * 60  # 80–81 °C for 10 minutes: warm, not climbing


def test_history_spans_the_window_whatever_the_report_rate() -> None:
    """Reports every 0.5 s: a climb of corrected errors over 5 minutes is still seen (the
    history keeps samples spaced over the window, not the last 64 reports)."""
    w = RiskWatch(RiskConfig(ce_delta=10, window_s=600))
    got = [w.observe("n", t * 0.5, {"edac_ce": t // 50}) for t in range(600)]  # +12 in 300 s
    hit = [i for i, why in enumerate(got) if why is not None]
    assert hit and got[hit[0]] is not None and got[hit[0]].startswith("edac_ce: 10 corrected")


def test_a_standby_at_risk_is_quarantined_not_used() -> None:
    s, obs = running(1000.0)
    new, events = decide(s, obs, 1000.0, cfg(), [], Inputs(quarantine={"node2": "at risk: x"}))
    assert new.pools["node2"] == Pool.FAULTY and new.phase == Phase.RUNNING
    (moved,) = [d for k, d in events if k == "pool_changed"]
    assert moved["node"] == "node2" and moved["reason"].startswith("at risk: x")
    # A running node is drained by evict instead; quarantine leaves it alone.
    new, _ = decide(s, obs, 1000.0, cfg(), [], Inputs(quarantine={"node0": "at risk: x"}))
    assert new.pools["node0"] == Pool.RUNNING
