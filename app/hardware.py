"""The machine Hearth runs on: CPU facts, NVIDIA GPUs through NVML (opened once), a description for benchmarks."""

from __future__ import annotations

import functools
import logging
import os
import platform
import threading
from dataclasses import dataclass
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
    """Whether an NVML failure only says "no driver / no GPU / not on this card" (not worth a warning)."""
    if isinstance(error, ImportError):
        return True
    text = str(error).lower()
    return any(s in text for s in ("driver not loaded", "not found", "libnvidia-ml", "no devices", "not supported"))


# NVML is read every second by the sampler and at every load by the budget: each distinct failure
# is logged once, later repeats only at debug level.
_reported: set[str] = set()
_reported_lock = threading.Lock()


def report_nvml_error(what: str, error: Exception) -> None:
    """Log an NVML failure once: "no GPU" and "not supported" at info, anything else as a warning."""
    message = f"{what}: {error}"
    with _reported_lock:
        first = message not in _reported
        _reported.add(message)
    if not first:
        log.debug("%s", message)
    elif _no_gpu(error):
        log.info("%s", message)
    else:
        log.warning("%s", message)


def init_nvml(nvml: Any) -> Any | None:
    """nvmlInit() on a pynvml(-like) module: the module, or None (logged) when NVML cannot be opened."""
    try:
        nvml.nvmlInit()
    except Exception as error:  # NVMLError: no driver, no permission, a driver/library mismatch
        report_nvml_error("NVML could not be opened, GPU readings are off", error)
        return None
    return nvml


@functools.cache
def open_nvml() -> Any | None:
    """The initialised pynvml module, or None without the library, the driver or a GPU (opened once per process)."""
    try:
        import pynvml
    except ImportError as error:
        report_nvml_error("no NVIDIA GPU readings (pynvml is not installed)", error)
        return None
    return init_nvml(pynvml)


def nvml_gpus(nvml: Any = None) -> tuple[Any, list[Any]] | None:
    """(pynvml, device handles) when NVML sees NVIDIA GPUs; None on a CPU-only machine.

    `nvml` is an opened pynvml-like module (tests pass fakes); by default the process's open_nvml().
    """
    nvml = open_nvml() if nvml is None else nvml
    if nvml is None:
        return None
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    except Exception as error:  # NVMLError, e.g. "GPU is lost"
        report_nvml_error("NVML lists no devices", error)
        return None
    return (nvml, handles) if handles else None


def gpu_name(nvml: Any, handle: Any) -> str:
    """A GPU's name (older NVML bindings return bytes)."""
    name = nvml.nvmlDeviceGetName(handle)
    return name.decode("utf-8", errors="replace") if isinstance(name, bytes) else str(name)


@dataclass(frozen=True)
class GpuMemory:
    """One NVIDIA GPU's memory as NVML reports it now."""

    name: str
    total_bytes: int
    free_bytes: int


def gpu_memory(nvml: Any = None) -> tuple[list[GpuMemory], str]:
    """Memory per NVIDIA GPU and a note saying where it came from; no GPUs (and why) when NVML has none."""
    gpus = nvml_gpus(nvml)
    if gpus is None:
        return [], "no NVIDIA GPU through NVML (driver, library or device missing; see the log)"
    module, handles = gpus
    try:
        found = []
        for handle in handles:
            info = module.nvmlDeviceGetMemoryInfo(handle)
            found.append(GpuMemory(gpu_name(module, handle), int(info.total), int(info.free)))
    except Exception as error:  # NVMLError
        report_nvml_error("NVML could not read the GPUs' memory", error)
        return [], f"NVML could not read the GPUs ({error})"
    return found, f"VRAM of {len(found)} NVIDIA GPU(s) via NVML"


def machine() -> dict:
    """The machine figures were taken on: CPU, cores, RAM, GPUs, Python, load average."""
    gpus = nvml_gpus()
    return {
        "cpu": cpu_model(),
        "cores": usable_cores(),
        "ram_bytes": psutil.virtual_memory().total,
        "gpu": [gpu_name(gpus[0], h) for h in gpus[1]] if gpus else None,
        "python": platform.python_version(),
        "load_avg": os.getloadavg(),
    }
