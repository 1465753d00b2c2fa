"""The memory budget resident models must fit in: GPU memory via NVML, else the GPUs llama.cpp's Vulkan build sees
(app.device_probe, when the runners use it), else RAM via psutil.

No NVIDIA library, driver or GPU is the ordinary case on a NAS, not an error: the budget is
then RAM. Inside a container RAM is also capped by the cgroup's memory limit, which psutil does
not see, so the limit is read from /sys/fs/cgroup as well.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from app.devices import Device
from app.hardware import gpu_memory

MIB = 1024 * 1024
KIND_VRAM = "vram"
KIND_RAM = "ram"
# Share of the total kept free by default: drivers, the OS page cache and other services
# need room, and an estimate can be off by its own ~10%.
DEFAULT_RESERVE_FRACTION = 0.10
# On small RAM boxes 10% is too little for the OS and Hearth's own gateway process.
MIN_RAM_RESERVE_BYTES = 512 * MIB
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 reports "no limit" as a page-rounded 2^63; anything this large means unlimited.
_UNLIMITED_BYTES = 1 << 60


@dataclass(frozen=True)
class MemoryBudget:
    """Memory of one kind (VRAM or RAM) and how much of it resident models may use."""

    kind: str
    total_bytes: int
    available_bytes: int
    reserve_bytes: int
    usable_bytes: int
    configured_limit_bytes: int | None = None
    devices: tuple[str, ...] = ()
    # Why this kind was chosen ("no NVIDIA driver: …"), for the dashboard and logs.
    detail: str = ""

    def headroom_bytes(self, resident_bytes: int) -> int:
        """Returns how much a new load may take with resident_bytes already held by Hearth."""
        # Both limits hold: the budget Hearth's models share, and what is free right now
        # (other processes use memory too) less the reserve.
        within_budget = self.usable_bytes - resident_bytes
        free_now = self.available_bytes - self.reserve_bytes
        return max(0, min(within_budget, free_now))


def counts_ram_tier(kind: str) -> bool:
    """Whether a budget of this kind reserves the runners' RAM tiers: a RAM budget does (host RAM the runner may
    fill with evicted prompt KV); a VRAM budget does not (the tier never takes GPU memory)."""
    return kind == KIND_RAM


def counted_bytes(estimate, kind: str) -> int:
    """The part of a runner's estimate (app.residency.estimate.MemoryEstimate) a budget of this kind reserves."""
    return estimate.total_bytes if counts_ram_tier(kind) else estimate.total_bytes - estimate.ram_tier_bytes


def detect_budget(
    reserve_bytes: int | None = None,
    limit_bytes: int | None = None,
    nvml: Any = None,
    *,
    use_gpu: bool = True,
    virtual_memory: Callable[[], Any] = psutil.virtual_memory,
    cgroup_root: Path = CGROUP_ROOT,
    devices: tuple[Device, ...] = (),
) -> MemoryBudget:
    """Measures the budget: NVIDIA GPUs when NVML finds any (and use_gpu), else the GPUs among `devices`, else RAM.

    `nvml` is an opened pynvml-like module (tests pass fakes); by default the process's one (app.hardware).
    `devices`: what llama.cpp's backends see (app.device_probe; Intel/AMD GPUs through Vulkan).
    """
    if reserve_bytes is not None and reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must not be negative (got {reserve_bytes})")
    if limit_bytes is not None and limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be positive (got {limit_bytes})")
    detail = "GPU not wanted (use_gpu=False)"
    if use_gpu:
        gpus, note = gpu_memory(nvml)
        if gpus:
            total = sum(g.total_bytes for g in gpus)
            free = sum(g.free_bytes for g in gpus)
            if reserve_bytes is None:
                reserve_bytes = int(total * DEFAULT_RESERVE_FRACTION)
            return _budget(KIND_VRAM, total, free, reserve_bytes, limit_bytes, tuple(g.name for g in gpus), note)
        offload = [d for d in devices if d.is_gpu]
        if offload:
            total = sum(d.total_bytes for d in offload)
            # A driver that does not report use (lavapipe) says all is free: Hearth's own count of what its runners
            # hold (the residency's estimates against usable_bytes) is then the only limit.
            free = sum(d.free_bytes if d.reports_usage else d.total_bytes for d in offload)
            if reserve_bytes is None:
                reserve_bytes = int(total * DEFAULT_RESERVE_FRACTION)
            names = tuple(f"{d.name} ({d.description})" for d in offload)
            return _budget(KIND_VRAM, total, free, reserve_bytes, limit_bytes, names,
                           f"memory of {len(offload)} {offload[0].backend} device(s) as llama.cpp reports it")
        detail = f"RAM: {note}"
    memory = virtual_memory()
    total, available = memory.total, memory.available
    cgroup_limit, cgroup_usage = _cgroup_memory(cgroup_root)
    if cgroup_limit is not None and cgroup_limit < total:
        total = cgroup_limit
        available = min(available, max(0, cgroup_limit - (cgroup_usage or 0)))
        detail = f"{detail}; RAM capped by the cgroup memory limit"
    if reserve_bytes is None:
        reserve_bytes = max(int(total * DEFAULT_RESERVE_FRACTION), MIN_RAM_RESERVE_BYTES)
    return _budget(KIND_RAM, total, available, reserve_bytes, limit_bytes, (), detail)


def _budget(
    kind: str,
    total: int,
    available: int,
    reserve: int,
    limit: int | None,
    devices: tuple[str, ...],
    detail: str,
) -> MemoryBudget:
    """Builds the budget; a configured limit replaces total − reserve as the usable share."""
    usable = limit if limit is not None else max(0, total - reserve)
    return MemoryBudget(
        kind=kind,
        total_bytes=total,
        available_bytes=available,
        reserve_bytes=reserve,
        usable_bytes=usable,
        configured_limit_bytes=limit,
        devices=devices,
        detail=detail,
    )


def _cgroup_memory(root: Path) -> tuple[int | None, int | None]:
    """Returns this process's tightest cgroup memory limit and that cgroup's usage, if any."""
    best: tuple[int | None, int | None] = (None, None)
    for directory, limit_name, usage_name in _cgroup_dirs(root):
        limit = _read_bytes(directory / limit_name)
        if limit is None or limit >= _UNLIMITED_BYTES:
            continue
        if best[0] is None or limit < best[0]:
            best = (limit, _read_bytes(directory / usage_name))
    return best


def _cgroup_dirs(root: Path) -> list[tuple[Path, str, str]]:
    """Lists this process's cgroup folders and their ancestors, for cgroup v2 and v1."""
    v2_path = v1_path = "/"
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            if hierarchy == "0" and controllers == "":
                v2_path = path
            elif "memory" in controllers.split(","):
                v1_path = path
    except (OSError, ValueError):
        pass
    candidates = []
    # A limit may be set on any ancestor (a systemd slice, the container's cgroup); inside a
    # container's cgroup namespace the paths are relative to the mounted root.
    for base, path, limit_name, usage_name in (
        (root, v2_path, "memory.max", "memory.current"),
        (root / "memory", v1_path, "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        directory = base / path.lstrip("/")
        while True:
            candidates.append((directory, limit_name, usage_name))
            if directory == base or base not in directory.parents:
                break
            directory = directory.parent
    return candidates


def _read_bytes(path: Path) -> int | None:
    """Reads a cgroup byte count; None when absent, unreadable or "max"."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
