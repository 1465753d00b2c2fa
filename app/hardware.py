"""The machine Hearth runs on: CPU facts, NVIDIA GPUs through NVML (opened once), a description for benchmarks."""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

_CPUINFO = Path("/proc/cpuinfo")


def cpu_has_amx() -> bool:
    """True when /proc/cpuinfo lists AMX (int8 tiles)."""
    try:
        return "amx_int8" in _CPUINFO.read_text()
    except OSError:
        return False


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform's guess elsewhere)."""
    try:
        for line in _CPUINFO.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity, not the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _no_gpu(error: Exception) -> bool:
    """Whether an NVML failure only says "no driver / no GPU here" (not worth a warning)."""
    if isinstance(error, ImportError):
        return True
    text = str(error).lower()
    return any(s in text for s in ("driver not loaded", "not found", "libnvidia-ml", "no devices", "not supported"))


@functools.cache
def open_nvml() -> Any | None:
    """The initialised pynvml module, or None without the library, the driver or a GPU (tried once)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as error:  # ImportError or NVMLError
        if _no_gpu(error):
            log.info("no NVIDIA GPU: %s", error)
        else:
            log.warning("NVML could not be opened, GPU readings are off: %s", error)
        return None
    return pynvml


def nvml_gpus() -> tuple[Any, list[Any]] | None:
    """(pynvml, device handles) when NVML sees NVIDIA GPUs; None on a CPU-only machine."""
    nvml = open_nvml()
    if nvml is None:
        return None
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    except nvml.NVMLError as error:
        log.warning("NVML lists no devices: %s", error)
        return None
    return (nvml, handles) if handles else None


def machine() -> dict:
    """The machine figures were taken on: CPU, cores, RAM, GPUs, Python, load average."""
    gpus = nvml_gpus()
    return {
        "cpu": cpu_model(),
        "cores": usable_cores(),
        "ram_bytes": psutil.virtual_memory().total,
        "gpu": [gpus[0].nvmlDeviceGetName(h) for h in gpus[1]] if gpus else None,
        "python": platform.python_version(),
        "load_avg": os.getloadavg(),
    }
