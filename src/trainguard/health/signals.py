"""Hardware health counters a node's agent reports, for failure prediction (seed 003: watch
the hardware, act before it fails). Every source is optional and skipped cleanly when absent:

- host memory EDAC (``/sys/devices/system/edac/mc/mc*/{ce,ue}_count``): corrected and
  uncorrected memory errors since boot;
- GPUs through NVML (nvidia-ml-py): volatile corrected and uncorrected ECC counts, retired
  pages (pending included), the hottest GPU's temperature and its slowdown threshold.

``TRAINGUARD_SIGNALS_ROOT`` replaces ``/`` for the sysfs sources (a directory of counter files
a test writes; with ``{node}`` in it, the node id is filled in).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

ENV_ROOT = "TRAINGUARD_SIGNALS_ROOT"


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


def _nvml() -> dict[str, float]:
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
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for kind, key in (
                (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, "gpu_ecc_ce"),
                (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, "gpu_ecc_ue"),
            ):
                try:
                    n = pynvml.nvmlDeviceGetTotalEccErrors(h, kind, pynvml.NVML_VOLATILE_ECC)
                    out[key] = out.get(key, 0.0) + float(n)
                except pynvml.NVMLError:
                    pass
            try:
                pages = 0
                for cause in (
                    pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                    pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
                ):
                    pages += len(pynvml.nvmlDeviceGetRetiredPages(h, cause))
                out["gpu_retired_pages"] = out.get("gpu_retired_pages", 0.0) + pages
            except pynvml.NVMLError:
                pass
            temp = float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))
            if temp >= out.get("gpu_temp_c", -1.0):
                out["gpu_temp_c"] = temp
                with contextlib.suppress(pynvml.NVMLError):
                    out["gpu_temp_slowdown_c"] = float(
                        pynvml.nvmlDeviceGetTemperatureThreshold(
                            h, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
                        )
                    )
    except pynvml.NVMLError:
        pass
    finally:
        pynvml.nvmlShutdown()
    return out


def read_signals(node_id: str) -> dict[str, Any]:
    """The node's counters now, name → value (only the sources present). Never raises."""
    try:
        return {**_edac(_root(node_id)), **_nvml()}
    except Exception:  # a broken source must not stop the node's reports
        return {}
