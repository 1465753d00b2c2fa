"""Stored settings as the request path reads them: cached a few seconds, so serving never waits on SQLite."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from cachetools import TTLCache
from sqlalchemy.orm import sessionmaker

from app.device_probe import cached_probe, is_software_vulkan
from app.devices import Device
from app.llama_tools import BACKEND_ENV
from app.residency.budget import MemoryBudget, detect_budget, device_budgets
from app.store.settings import REGISTRY, get_setting

MIB = 1024 * 1024
SETTINGS_TTL_S = 5.0
_MISSING = object()  # a stored setting may be None, so a miss needs its own marker


class SettingsCache:
    """Settings by name; an edit made anywhere (dashboard, CLI) applies within ttl_s."""

    def __init__(self, sessions: sessionmaker, ttl_s: float = SETTINGS_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        self._sessions = sessions
        self._lock = threading.Lock()
        # One entry per registered setting at most: the registry bounds the cache.
        self._cache: TTLCache = TTLCache(maxsize=max(1, len(REGISTRY)), ttl=ttl_s, timer=clock)

    def get(self, name: str) -> Any:
        """The stored value (or the registry default) of a setting; raises UnknownSetting for a bad name."""
        with self._lock:
            value = self._cache.get(name, _MISSING)
        if value is not _MISSING:
            return value
        with self._sessions() as s:
            value = get_setting(s, name)
        with self._lock:
            self._cache[name] = value
        return value

    def invalidate(self) -> None:
        """Read every setting again on its next lookup."""
        with self._lock:
            self._cache.clear()


def memory_budget(settings: SettingsCache) -> MemoryBudget:
    """The memory budget (kind, usable bytes) under the stored limit and reserve."""
    limit = settings.get("memory_limit_mb")
    reserve = settings.get("memory_reserve_mb")
    return detect_budget(
        reserve_bytes=None if reserve is None else int(reserve) * MIB,
        limit_bytes=None if limit is None else int(limit) * MIB,
        devices=offload_devices(),
    )


def offload_devices() -> tuple[Device, ...]:
    """The devices the runners' llama.cpp build sees, when it is one that offloads (HEARTH_LLAMA_BACKEND=vulkan);
    none with the default CPU build, which then starts no probe at all."""
    if (os.environ.get(BACKEND_ENV) or "cpu").strip().lower() == "cpu":
        return ()
    return cached_probe().devices


def memory_budgets(settings: SettingsCache) -> dict[str, MemoryBudget]:
    """The budget per device: RAM ("CPU", under the stored limit and reserve) and each GPU the runners' llama.cpp
    build sees, by its name ("Vulkan0"), its total less 10 %."""
    limit = settings.get("memory_limit_mb")
    reserve = settings.get("memory_reserve_mb")
    ram = detect_budget(reserve_bytes=None if reserve is None else int(reserve) * MIB,
                        limit_bytes=None if limit is None else int(limit) * MIB, use_gpu=False)
    return device_budgets(ram, offload_devices())


def device_budget_bytes(settings: SettingsCache) -> dict[str, int]:
    """Usable bytes per device, for the residency's budget per device (memory_budgets)."""
    return {name: b.usable_bytes for name, b in memory_budgets(settings).items()}


def budget_bytes(settings: SettingsCache) -> int:
    """Memory resident models may use, under the stored limit and reserve."""
    return memory_budget(settings).usable_bytes


def flash_attn_possible(gpu_layers: int) -> bool:
    """Whether a runner with these GPU layers loads with flash attention (llama.cpp's auto): not where its layers go
    to lavapipe, where "auto" is off (app.engine.backends.flash_attn_for), so its estimate counts the scores."""
    return not (gpu_layers and any(d.is_gpu and is_software_vulkan(d.description) for d in offload_devices()))
