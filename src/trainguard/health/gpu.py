"""GPU health through NVML (nvidia-ml-py): count, memory in use, ECC errors, temperature,
throttling. Without an NVIDIA driver every function returns empty results (skipped cleanly).
"""

from __future__ import annotations

from typing import Any

# Clock-throttle reasons that mean the GPU is slowed by a fault or its environment, not by
# being idle or by an application clock setting (NVML's nvmlClocksThrottleReason* bits).
_BAD_THROTTLE = {
    0x0000000000000008: "hw_slowdown",
    0x0000000000000020: "sw_thermal",
    0x0000000000000040: "hw_thermal",
    0x0000000000000080: "hw_power_brake",
}


def measure() -> list[dict[str, Any]]:
    """One dict per GPU: ``index``, ``name``, ``memory_used`` (bytes), ``ecc_uncorrected``
    (volatile count, None where ECC is off), ``temperature_c``, ``throttle`` (names of
    fault throttle reasons active). [] when NVML or a driver is absent."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                ecc: int | None = pynvml.nvmlDeviceGetTotalEccErrors(
                    h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                )
            except pynvml.NVMLError:
                ecc = None
            reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
            name = pynvml.nvmlDeviceGetName(h)
            out.append(
                {
                    "index": i,
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "memory_used": int(pynvml.nvmlDeviceGetMemoryInfo(h).used),
                    "ecc_uncorrected": ecc,
                    "temperature_c": int(
                        pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
                    ),
                    "throttle": [n for bit, n in _BAD_THROTTLE.items() if reasons & bit],
                }
            )
    finally:
        pynvml.nvmlShutdown()
    return out
