"""Hardware health counters a node's agent reports, for failure prediction (seed 003: watch
the hardware, act before it fails). Every source is optional and skipped cleanly when absent:

- host memory EDAC (``/sys/devices/system/edac/mc/mc*/{ce,ue}_count``): corrected and
  uncorrected memory errors since boot (``edac_ce``, ``edac_ue``);
- GPUs through NVML (nvidia-ml-py): volatile corrected and uncorrected ECC counts
  (``gpu_ecc_ce``, ``gpu_ecc_ue``), retired pages, pending included (``gpu_retired_pages``),
  the hottest GPU's temperature and its slowdown threshold (``gpu_temp_c``,
  ``gpu_temp_slowdown_c``), GPUs held back by a hardware or thermal slowdown now
  (``gpu_throttled``: NVML's clocks-event reasons HW_SLOWDOWN, HW_THERMAL_SLOWDOWN,
  SW_THERMAL_SLOWDOWN);
- the kernel log (``/dev/kmsg``, read from the agent's start on, needs root): NVIDIA driver
  Xid errors (``gpu_xid``: count; ``gpu_xid_critical``: those whose code NVIDIA's Xid
  catalogue says need the GPU drained or reset, ``CRITICAL_XIDS``; ``gpu_xid_last``: the
  newest code) and block-device I/O errors (``io_errors``);
- disks through smartmontools (``smartctl --json``, every ``SMART_S``): the overall health
  verdict (``smart_failed``: disks failing it) and the counters that precede a failure
  (``smart_reallocated``, ``smart_pending``, ``smart_uncorrectable`` of ATA attributes 5, 197,
  198; ``smart_media_errors`` and ``smart_critical_warning`` of NVMe's health log).

``TRAINGUARD_SIGNALS_ROOT`` replaces ``/`` for the file sources (a directory of counter files
a test writes; with ``{node}`` in it, the node id is filled in): sysfs as above, ``dev/kmsg``
read as a plain file of kernel-log lines, ``smart/*.json`` as smartctl's JSON output per disk,
and ``nvml.json`` (the NVML counters above, as a JSON object) in place of NVML.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

ENV_ROOT = "TRAINGUARD_SIGNALS_ROOT"
SMART_S = 600.0  # smartctl wakes disks and takes a second or more a disk: seldom
SMART_TIMEOUT_S = 30.0
# Xid codes NVIDIA's "Xid Errors" catalogue and its GPU debug guidelines treat as hardware
# faults needing a drain or reset (48 DBE ECC, 61/62 internal micro-controller, 63/64 row
# remapping, 74 NVLink, 79 fallen off the bus, 92 high single-bit ECC rate, 94/95 contained /
# uncontained ECC, 119/120 GSP); others (13, 31, 43, …) are mostly the application's.
CRITICAL_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120})
_XID = re.compile(r"NVRM: Xid \([^)]*\): (\d+)")
_IO = re.compile(r"I/O error, dev \S+|Buffer I/O error on dev|critical medium error")
_ATA = {5: "smart_reallocated", 197: "smart_pending", 198: "smart_uncorrectable"}
_THROTTLE_BITS = (
    "nvmlClocksEventReasonHwSlowdown",
    "nvmlClocksEventReasonHwThermalSlowdown",
    "nvmlClocksEventReasonSwThermalSlowdown",
)


def _root(node_id: str) -> Path:
    return Path(os.environ.get(ENV_ROOT, "/").replace("{node}", node_id))


def _edac(root: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, key in (("ce_count", "edac_ce"), ("ue_count", "edac_ue")):
        total, seen = 0, False
        for f in (root / "sys/devices/system/edac/mc").glob(f"mc*/{name}"):
            try:
                total += int(f.read_text().strip())
                seen = True
            except (OSError, ValueError):
                continue
        if seen:
            out[key] = float(total)
    return out


def _nvml_device(pynvml: Any, h: Any, out: dict[str, float]) -> None:
    for kind, key in (
        (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, "gpu_ecc_ce"),
        (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, "gpu_ecc_ue"),
    ):
        with contextlib.suppress(pynvml.NVMLError):
            n = pynvml.nvmlDeviceGetTotalEccErrors(h, kind, pynvml.NVML_VOLATILE_ECC)
            out[key] = out.get(key, 0.0) + float(n)
    with contextlib.suppress(pynvml.NVMLError):
        pages = 0
        for cause in (
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        ):
            pages += len(pynvml.nvmlDeviceGetRetiredPages(h, cause))
        out["gpu_retired_pages"] = out.get("gpu_retired_pages", 0.0) + pages
    with contextlib.suppress(pynvml.NVMLError):
        reasons = pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
        mask = 0
        for name in _THROTTLE_BITS:
            mask |= int(getattr(pynvml, name, 0))
        out["gpu_throttled"] = out.get("gpu_throttled", 0.0) + (1.0 if reasons & mask else 0.0)
    temp = float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))
    if temp >= out.get("gpu_temp_c", -1.0):
        out["gpu_temp_c"] = temp
        with contextlib.suppress(pynvml.NVMLError):
            out["gpu_temp_slowdown_c"] = float(
                pynvml.nvmlDeviceGetTemperatureThreshold(
                    h, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
                )
            )


def _nvml(root: Path) -> dict[str, float]:
    stand_in = root / "nvml.json"
    if stand_in.exists():  # a test's stand-in for the GPUs
        with contextlib.suppress(OSError, ValueError):
            d = json.loads(stand_in.read_text())
            return {k: float(v) for k, v in d.items() if isinstance(v, int | float)}
        return {}
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return {}
    out: dict[str, float] = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            _nvml_device(pynvml, pynvml.nvmlDeviceGetHandleByIndex(i), out)
    except pynvml.NVMLError:
        pass
    finally:
        pynvml.nvmlShutdown()
    return out


def _smart_of(report: dict[str, Any], out: dict[str, float]) -> None:
    """Fold one disk's ``smartctl --json -a`` report into ``out`` (sums over disks)."""

    def add(key: str, v: float) -> None:
        out[key] = out.get(key, 0.0) + v

    status = report.get("smart_status")
    if isinstance(status, dict) and "passed" in status:
        add("smart_failed", 0.0 if status["passed"] else 1.0)
    for attr in (report.get("ata_smart_attributes") or {}).get("table", []):
        key = _ATA.get(int(attr.get("id", -1)))
        if key is not None:
            add(key, float((attr.get("raw") or {}).get("value", 0)))
    nvme = report.get("nvme_smart_health_information_log")
    if isinstance(nvme, dict):
        add("smart_media_errors", float(nvme.get("media_errors", 0)))
        add("smart_critical_warning", 1.0 if nvme.get("critical_warning") else 0.0)


class SignalReader:
    """One node's signal sources, read incrementally (``read()`` every few seconds): the
    kernel log from where the previous read stopped, SMART every ``SMART_S``."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._kmsg_fd: int | None = None
        self._kmsg_pos = 0  # a stand-in file: the offset read up to
        self._kmsg_started = False
        self._log = {"gpu_xid": 0.0, "gpu_xid_critical": 0.0, "io_errors": 0.0}
        self._xid_last: float | None = None
        self._kmsg_seen = False
        self._smart: dict[str, float] = {}
        self._smart_at = -1e18

    def read(self) -> dict[str, Any]:
        """The node's counters now, name → value (only the sources present). Never raises."""
        root = _root(self.node_id)
        out: dict[str, Any] = {}
        for source in (_edac, _nvml, self._kernel_log, self._smartctl):
            try:
                out.update(source(root))
            except Exception:  # a broken source must not stop the node's reports
                continue
        return out

    def close(self) -> None:
        if self._kmsg_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._kmsg_fd)
            self._kmsg_fd = None

    # ---------------------------------------------------------------- kernel log
    def _kernel_log(self, root: Path) -> dict[str, float]:
        for line in self._new_log_lines(root):
            m = _XID.search(line)
            if m:
                code = int(m.group(1))
                self._log["gpu_xid"] += 1
                self._log["gpu_xid_critical"] += code in CRITICAL_XIDS
                self._xid_last = float(code)
            elif _IO.search(line):
                self._log["io_errors"] += 1
        if not self._kmsg_seen:
            return {}
        out = dict(self._log)
        if self._xid_last is not None:
            out["gpu_xid_last"] = self._xid_last
        return out

    def _new_log_lines(self, root: Path) -> list[str]:
        path = root / "dev/kmsg"
        if str(root) != "/":  # a test's stand-in: a plain file of log lines
            try:
                with open(path, "rb") as f:
                    f.seek(self._kmsg_pos)
                    data = f.read()
            except OSError:
                return []
            self._kmsg_seen = True
            end = data.rfind(b"\n") + 1
            self._kmsg_pos += end
            return data[:end].decode(errors="replace").splitlines()
        if self._kmsg_fd is None:
            if self._kmsg_started:
                return []  # it could not be opened before (not root): not again
            self._kmsg_started = True
            try:
                self._kmsg_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                os.lseek(self._kmsg_fd, 0, os.SEEK_END)  # from now on: not the boot's history
            except OSError:
                return []
        self._kmsg_seen = True
        lines: list[str] = []
        while len(lines) < 10_000:  # one record a read (the kmsg interface); bounded
            try:
                rec = os.read(self._kmsg_fd, 8192)
            except BlockingIOError:
                break
            except OSError:  # EPIPE: records overwritten before we read them; go on
                continue
            if not rec:
                break
            lines.append(rec.decode(errors="replace").split(";", 1)[-1])
        return lines

    # ---------------------------------------------------------------- SMART
    def _smartctl(self, root: Path) -> dict[str, float]:
        now = time.monotonic()
        if now - self._smart_at < SMART_S:
            return self._smart
        self._smart_at = now
        out: dict[str, float] = {}
        if str(root) != "/":
            for f in sorted((root / "smart").glob("*.json")):
                with contextlib.suppress(OSError, ValueError):
                    _smart_of(json.loads(f.read_text()), out)
            self._smart_at = -1e18  # files a test rewrites: read every time
        elif shutil.which("smartctl"):
            scan = _run_json(["smartctl", "--scan", "--json"])
            for dev in (scan or {}).get("devices", []):
                report = _run_json(["smartctl", "--json", "-H", "-A", dev["name"]])
                if report is not None:
                    _smart_of(report, out)
        self._smart = out
        return out


def _run_json(cmd: list[str]) -> dict[str, Any] | None:
    """A command's JSON output (smartctl exits non-zero with its bits for disk warnings, and
    still prints the report), or None."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=SMART_TIMEOUT_S)
        d = json.loads(res.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return d if isinstance(d, dict) else None


def read_signals(node_id: str) -> dict[str, Any]:
    """One read of every source (a fresh ``SignalReader``: the kernel log from now on only).
    Never raises."""
    reader = SignalReader(node_id)
    try:
        return reader.read()
    finally:
        reader.close()
