"""The devices a runner would see, read in a child process (`python -m app.engine.backends`) with the runner's
environment: serve itself never initialises a GPU driver (a Vulkan instance or a CUDA context in the gateway would
hold device memory and could crash it), and the child loads the same llama.cpp build the runners load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from app.devices import Device
from app.llama_tools import BACKEND_ENV, LlamaToolsNotFound, llama_lib_env

# Mesa's software Vulkan device: its driver reports one fixed heap whatever is allocated. Runners there load with
# flash attention off unless told otherwise: on a box like this one (issue 39) it segfaulted inside
# libvulkan_lvp.so at the first request; with this build here it answered (the tiny model and Gemma 3 270M, stock
# llama-server and Hearth), but stock llama-server took 55 s for Gemma's first 6 tokens with it on.
_SOFTWARE_VULKAN = ("llvmpipe", "lavapipe")

# A Vulkan instance on lavapipe takes ~1 s to come up, a CUDA context a few; a hung driver must not hang serve.
PROBE_TIMEOUT_S = 60.0
# Devices change only with drivers and hardware; free memory is read again after this long.
PROBE_TTL_S = 300.0


def is_software_vulkan(description: str) -> bool:
    """Whether a device is Mesa's lavapipe (llvmpipe): a Vulkan device that is really the CPU."""
    text = description.lower()
    return any(word in text for word in _SOFTWARE_VULKAN)


@dataclass(frozen=True)
class Probe:
    """What the probe found: the backend build asked for, its devices, and why there are none when it failed."""

    backend: str
    devices: tuple[Device, ...] = ()
    error: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # the llama.cpp settings it ran with (lib path, visible devices)

    @property
    def gpus(self) -> tuple[Device, ...]:
        """The devices layers can be offloaded to (-ngl)."""
        return tuple(d for d in self.devices if d.is_gpu)


def _visible_env(env: dict[str, str]) -> dict[str, str]:
    return {k: env[k] for k in ("GGML_VK_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") if k in env}


def probe_devices(environ: dict[str, str] | None = None, python: str = sys.executable,
                  timeout_s: float = PROBE_TIMEOUT_S) -> Probe:
    """Run the device probe in a child process with the runners' llama.cpp build and return what it printed."""
    env = dict(os.environ if environ is None else environ)
    backend = (env.get(BACKEND_ENV) or "cpu").strip().lower()
    try:
        env.update(llama_lib_env(env))
    except LlamaToolsNotFound as exc:
        return Probe(backend, error=str(exc), env=_visible_env(env))
    try:
        done = subprocess.run([python, "-m", "app.engine.backends"], env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Probe(backend, error=f"device probe failed: {exc}", env=_visible_env(env))
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-3:]
        return Probe(backend, error=f"device probe exited {done.returncode}: {' | '.join(tail)}", env=_visible_env(env))
    try:
        devices = tuple(Device(**row) for row in json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, TypeError, IndexError) as exc:
        return Probe(backend, error=f"device probe printed no device list ({exc})", env=_visible_env(env))
    return Probe(backend, devices=devices, env=_visible_env(env))


_cache_lock = threading.Lock()
_cached: tuple[float, Probe] | None = None
_running = False


def cached_probe(clock=time.monotonic) -> Probe:
    """probe_devices() at most once per PROBE_TTL_S in this process (the Status page and the budget read it)."""
    global _cached
    with _cache_lock:
        if _cached is not None and clock() - _cached[0] < PROBE_TTL_S:
            return _cached[1]
    probe = probe_devices()
    with _cache_lock:
        _cached = (clock(), probe)
    return probe


def peek_probe() -> Probe | None:
    """The last probe's result without running one (None before the first has finished)."""
    with _cache_lock:
        return _cached[1] if _cached is not None else None


def probe_in_background(clock=time.monotonic) -> None:
    """Start cached_probe() on a thread when no fresh result is cached and none is running: a page shows the
    devices without waiting on a child process."""
    global _running
    with _cache_lock:
        if _running or (_cached is not None and clock() - _cached[0] < PROBE_TTL_S):
            return
        _running = True

    def run() -> None:
        global _running
        try:
            cached_probe(clock)
        finally:
            with _cache_lock:
                _running = False

    threading.Thread(target=run, name="device-probe", daemon=True).start()
