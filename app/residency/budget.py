"""The memory budget resident models must fit in: GPU memory via NVML, else the GPUs llama.cpp's Vulkan build sees
(app.device_probe, when the runners use it), else RAM via psutil; and the same per device (RAM and each GPU), with the
plan that puts a model on the device with room, evicting only models that hold memory there.

No NVIDIA library, driver or GPU is the ordinary case on a NAS, not an error: the budget is
then RAM. Inside a container RAM is also capped by the cgroup's memory limit, which psutil does
not see, so the limit is read from /sys/fs/cgroup as well.
"""

from collections.abc import Callable, Mapping, Sequence
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
# The device of host RAM in a per-device budget, as llama.cpp names its CPU buffers (app.residency.placement.CPU).
RAM_DEVICE = "CPU"
# In a model's need per device: bytes for whichever GPU the residency places it on (a model that fits one GPU whole,
# its devices unset), started there with --device NAME.
ANY_GPU = "GPU"
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


def device_budgets(ram: MemoryBudget, devices: Sequence[Device] = (),
                   reserve_fraction: float = DEFAULT_RESERVE_FRACTION) -> dict[str, MemoryBudget]:
    """The budget per device: RAM (`ram`, a RAM budget from detect_budget(use_gpu=False), under the stored limit and
    reserve) as "CPU", and each GPU among `devices` as llama.cpp names it, its total less `reserve_fraction`."""
    out = {RAM_DEVICE: ram}
    for d in devices:
        if not d.is_gpu:
            continue
        # A driver that reports no use (lavapipe) says all is free: Hearth's own count is then the only limit.
        free = d.free_bytes if d.reports_usage else d.total_bytes
        out[d.name] = _budget(KIND_VRAM, d.total_bytes, free, int(d.total_bytes * reserve_fraction), None,
                              (f"{d.name} ({d.description})",), f"{d.backend} device as llama.cpp reports it")
    return out


def most_room(want: int, rooms: Mapping[str, int]) -> str | None:
    """Of the devices' rooms (bytes left), the one with the most that holds `want`; None if none does."""
    best = None
    for name, room in sorted(rooms.items()):
        if room >= want and (best is None or room > rooms[best]):
            best = name
    return best


def used_by_device(placed: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """Bytes per device held by the resident models (`placed`: each model's bytes per device)."""
    used: dict[str, int] = {}
    for by_device in placed.values():
        for device, n in by_device.items():
            used[device] = used.get(device, 0) + n
    return used


def plan_on_devices(need: Mapping[str, int], budgets: Mapping[str, int], placed: Mapping[str, Mapping[str, int]],
                    evictable: Sequence[str] = ()) -> tuple[dict[str, int], list[str]] | None:
    """Where a model goes and whom to evict: (its bytes per device as placed, the models to evict), or None.

    `need`: bytes per device ("CPU" for RAM; ANY_GPU for whichever GPU has room); `budgets`: usable bytes per device;
    `placed`: each resident model's bytes per device; `evictable`: the models that may go, least recently used first.
    A device short of room evicts only the models holding memory on it (a model on GPU1 stays for a load on GPU0).
    An ANY_GPU need goes to the GPU with the most room that holds it without evicting (app.residency.fit.place_on's
    rule), else to the first GPU, by room, that eviction clears."""
    used = used_by_device(placed)
    gpus = [d for d in budgets if d != RAM_DEVICE]
    if ANY_GPU in need and not gpus:
        # The GPU is gone since the catalog counted it (a driver or probe change): llama.cpp then keeps every layer
        # in RAM, and so does the plan.
        need = {RAM_DEVICE: sum(need.values())}
    if ANY_GPU in need:
        rooms = {d: budgets[d] - used.get(d, 0) for d in gpus}
        rest = {d: n for d, n in need.items() if d != ANY_GPU}
        first = most_room(need[ANY_GPU], rooms)
        order = ([first] if first else []) + sorted((d for d in gpus if d != first), key=lambda d: (-rooms[d], d))
        for gpu in order:
            concrete = dict(rest)
            concrete[gpu] = concrete.get(gpu, 0) + need[ANY_GPU]
            victims = _evictions(concrete, budgets, placed, used, evictable)
            if victims is not None:
                return concrete, victims
        return None
    victims = _evictions(need, budgets, placed, used, evictable)
    return None if victims is None else (dict(need), victims)


def short_devices(need: Mapping[str, int], budgets: Mapping[str, int], used: Mapping[str, int]) -> dict[str, int]:
    """The devices `need` does not fit on beside `used`, with the bytes each is short by (no budget: not limited)."""
    short = {}
    for device, n in need.items():
        if n and device in budgets and used.get(device, 0) + n > budgets[device]:
            short[device] = used.get(device, 0) + n - budgets[device]
    return short


def _evictions(need: Mapping[str, int], budgets: Mapping[str, int], placed: Mapping[str, Mapping[str, int]],
               used: Mapping[str, int], evictable: Sequence[str]) -> list[str] | None:
    """The least recently used models to evict, of those holding memory where `need` is short; None if not enough."""
    used = dict(used)
    victims: list[str] = []
    short = short_devices(need, budgets, used)
    for name in evictable:
        if not short:
            break
        held = placed.get(name, {})
        if not any(held.get(d, 0) for d in short):
            continue
        victims.append(name)
        for device, n in held.items():
            used[device] = used.get(device, 0) - n
        short = short_devices(need, budgets, used)
    return None if short else victims
