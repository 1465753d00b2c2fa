"""Intel and AMD GPUs as the kernel describes them: memory and utilisation from the amdgpu, i915 and xe sysfs files
and from DRM fdinfo (/proc/<pid>/fdinfo/<fd> of every open render node), for the sampler's GPU series where NVML
sees no NVIDIA GPU.

What each driver tells (Documentation/gpu/drm-usage-stats.rst and the drivers' sysfs ABI):
- amdgpu: device/mem_info_vram_total, mem_info_vram_used (bytes; an APU's carve-out too) and gpu_busy_percent.
- i915 and xe: no utilisation or memory file for the whole GPU; each DRM client's fdinfo says its engine time
  (i915: `drm-engine-render: <ns> ns`; xe: `drm-cycles-rcs: <n>` over `drm-total-cycles-rcs: <n>`) and its memory
  (`drm-resident-<region>: <n> KiB`), so the GPU's are the sums over its clients, busiest engine first.
Clients are told apart by `drm-client-id` (one client may be open through several fds, or inherited by children).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

GPU_DRIVERS = ("amdgpu", "i915", "xe")
_CARD = re.compile(r"^card(\d+)$")
_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


@dataclass(frozen=True)
class DrmCard:
    """One GPU's DRM card: its index, PCI address, kernel driver and sysfs device folder."""

    index: int
    pdev: str
    driver: str
    device_dir: Path


@dataclass
class _Client:
    """What one DRM client's fdinfo says: engine time (ns) or cycles per engine, and resident bytes."""

    engine_ns: dict[str, int] = field(default_factory=dict)
    cycles: dict[str, tuple[int, int]] = field(default_factory=dict)  # engine -> (cycles, total cycles)
    resident_bytes: int = 0


def list_cards(sys_root: Path = Path("/sys")) -> list[DrmCard]:
    """The amdgpu, i915 and xe cards under /sys/class/drm, by card number (NVIDIA's are NVML's)."""
    cards = []
    drm = sys_root / "class" / "drm"
    try:
        names = sorted(os.listdir(drm))
    except OSError:
        return []
    for name in names:
        match = _CARD.match(name)
        if not match:
            continue
        device = drm / name / "device"
        try:
            driver = os.path.basename(os.readlink(device / "driver"))
            pdev = os.path.basename(os.path.realpath(device))
        except OSError:
            continue
        if driver in GPU_DRIVERS:
            cards.append(DrmCard(int(match.group(1)), pdev, driver, device))
    return sorted(cards, key=lambda c: c.index)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _size(value: str) -> int | None:
    parts = value.split()
    try:
        return int(parts[0]) * _UNITS[parts[1] if len(parts) > 1 else ""]
    except (IndexError, KeyError, ValueError):
        return None


def read_clients(proc_root: Path = Path("/proc")) -> dict[str, dict[str, _Client]]:
    """Every DRM client this process can see, by PCI address then client id (fdinfo of all processes)."""
    found: dict[str, dict[str, _Client]] = {}
    try:
        pids = [p for p in os.listdir(proc_root) if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        fdinfo = proc_root / pid / "fdinfo"
        try:
            fds = os.listdir(fdinfo)
        except OSError:  # gone, or another user's process
            continue
        for fd in fds:
            try:
                text = (fdinfo / fd).read_text()
            except OSError:
                continue
            if "drm-client-id" not in text:
                continue
            fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            fields = {k.strip(): v.strip() for k, v in fields.items()}
            pdev, client_id = fields.get("drm-pdev"), fields.get("drm-client-id")
            if not pdev or client_id is None:
                continue
            client = found.setdefault(pdev, {}).setdefault(client_id, _Client())
            if client.engine_ns or client.cycles or client.resident_bytes:
                continue  # the same client through another fd
            for key, value in fields.items():
                if key.startswith("drm-engine-") and not key.startswith("drm-engine-capacity-"):
                    ns = _size(value.replace("ns", "").strip())
                    if ns is not None:
                        client.engine_ns[key.removeprefix("drm-engine-")] = ns
                elif key.startswith("drm-cycles-"):
                    engine = key.removeprefix("drm-cycles-")
                    total = fields.get(f"drm-total-cycles-{engine}")
                    if total is not None and value.isdigit() and total.isdigit():
                        client.cycles[engine] = (int(value), int(total))
                elif key.startswith("drm-resident-"):
                    client.resident_bytes += _size(value) or 0
    return found


class DrmSampler:
    """Readings per card (source `gpu:<i>`, the NVML series' names): amdgpu's files where they are, the sums of its
    clients' fdinfo otherwise; utilisation from fdinfo is a rate, so a card's first sample has none."""

    def __init__(self, sys_root: Path = Path("/sys"), proc_root: Path = Path("/proc")):
        self.sys_root = sys_root
        self.proc_root = proc_root
        self._last: dict[str, tuple[float, dict[str, int], dict[str, tuple[int, int]]]] = {}

    def sample(self, now: float) -> list[tuple[str, str, float]]:
        """(source, metric, value) for every amdgpu/i915/xe card; [] on a box without one."""
        cards = list_cards(self.sys_root)
        if not cards:
            return []
        clients = read_clients(self.proc_root)
        readings: list[tuple[str, str, float]] = []
        for i, card in enumerate(cards):
            source = f"gpu:{i}"
            own = clients.get(card.pdev, {})
            total = _read_int(card.device_dir / "mem_info_vram_total")
            used = _read_int(card.device_dir / "mem_info_vram_used")
            if used is None and own:
                used = sum(c.resident_bytes for c in own.values())
            if total is not None:
                readings.append((source, "vram_total_bytes", float(total)))
            if used is not None:
                readings.append((source, "vram_used_bytes", float(used)))
            busy = _read_int(card.device_dir / "gpu_busy_percent")
            if busy is None:
                busy = self._fdinfo_busy(card.pdev, own, now)
            if busy is not None:
                readings.append((source, "gpu_util_pct", float(busy)))
        return readings

    def _fdinfo_busy(self, pdev: str, own: dict[str, _Client], now: float) -> float | None:
        """The busiest engine's share of the time since the last sample, over all clients (None at the first)."""
        ns: dict[str, int] = {}
        cycles: dict[str, tuple[int, int]] = {}
        for client_id, client in own.items():
            for engine, value in client.engine_ns.items():
                ns[f"{client_id}/{engine}"] = value
            for engine, pair in client.cycles.items():
                cycles[f"{client_id}/{engine}"] = pair
        last = self._last.get(pdev)
        self._last[pdev] = (now, ns, cycles)
        if last is None or now <= last[0]:
            return None
        then, last_ns, last_cycles = last
        per_engine: dict[str, float] = {}
        for key, value in ns.items():
            engine = key.split("/", 1)[1]
            # A client that appeared since the last sample counts from zero; one that left counts nothing.
            per_engine[engine] = per_engine.get(engine, 0.0) + max(0, value - last_ns.get(key, 0))
        busy = [delta / ((now - then) * 1e9) * 100 for delta in per_engine.values()]
        spent: dict[str, list[int]] = {}
        for key, (value, total) in cycles.items():
            engine = key.split("/", 1)[1]
            old = last_cycles.get(key, (value, total))
            got = spent.setdefault(engine, [0, 0])
            got[0] += max(0, value - old[0])
            got[1] = max(got[1], total - old[1])
        busy += [used / elapsed * 100 for used, elapsed in spent.values() if elapsed > 0]
        return min(100.0, max(busy)) if busy else 0.0
