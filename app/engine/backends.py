"""The backends this process's llama.cpp carries and the devices they see (ggml_backend_dev_*), and the device
buffers llama.cpp allocates, counted from its own log lines.

Reading devices initialises every backend (a Vulkan instance, a CUDA context), so serve never does it itself:
it runs `python -m app.engine.backends` (app.device_probe), which prints the list as JSON, with the runner's
environment (the Vulkan build's libraries through LLAMA_CPP_LIB_PATH, GGML_VK_VISIBLE_DEVICES).
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
import threading
from dataclasses import asdict

from app.device_probe import is_software_vulkan
from app.devices import Device
from app.llama_tools import load_backends

# enum ggml_backend_dev_type; META (a virtual device spanning others) is not a device of its own.
_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


# "load_tensors:      Vulkan0 model buffer size =    65.00 MiB", "llama_kv_cache:    Vulkan0 KV buffer size =
# 21.00 MiB", "llama_context:    Vulkan0 compute buffer size =    19.00 MiB": llama.cpp's own sizes of what it
# allocated on each buffer type (CPU, CPU_Mapped, Vulkan_Host, Vulkan0, ...).
_BUFFER_LINE = re.compile(r"(\S+) (model|KV|compute|output|RS) buffer size =\s*([0-9.]+) MiB")
_OFFLOAD_LINE = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_MIB = 1024 * 1024


def _ggml() -> ctypes.CDLL:
    """libggml as llama.cpp loaded it: opened by its soname, so the loaded copy (the registry llama.cpp uses,
    from LLAMA_CPP_LIB_PATH or the wheel) is found again instead of a second copy from another folder."""
    load_backends()
    lib = ctypes.CDLL("libggml.so.0")
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).restype = ctypes.c_char_p
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_memory.restype = None
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    lib.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_name.restype = ctypes.c_char_p
    lib.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    return lib


def list_devices() -> list[Device]:
    """Every device llama.cpp's backends see in this process, in its own order (CPU last as it lists it)."""
    lib = _ggml()
    found = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = _KINDS.get(lib.ggml_backend_dev_type(dev))
        if kind is None:
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        description = (lib.ggml_backend_dev_description(dev) or b"").decode("utf-8", "replace")
        backend = (lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev)) or b"").decode()
        # A Vulkan driver without VK_EXT_memory_budget reports its heap as free whatever is allocated (lavapipe:
        # 2048/2048 MiB always); the CPU's figure is the host's, not a device's use.
        reports_usage = kind != "cpu" and not (backend == "Vulkan" and (free.value == total.value
                                                                        or is_software_vulkan(description)))
        found.append(Device(name=(lib.ggml_backend_dev_name(dev) or b"").decode(), backend=backend, kind=kind,
                            description=description, total_bytes=int(total.value), free_bytes=int(free.value),
                            reports_usage=reports_usage))
    return found


def flash_attn_for(devices: list[Device], n_gpu_layers: int, asked: str) -> tuple[str, str | None]:
    """The flash-attention setting to load with, and why it was changed (None when it was not): "auto" is off when
    layers go to Mesa's lavapipe (app.device_probe's note); an explicit "on" stands."""
    if n_gpu_layers > 0 and asked == "auto" and any(d.backend == "Vulkan" and is_software_vulkan(d.description)
                                                    for d in devices):
        return "off", "flash attention auto -> off: layers go to lavapipe (software Vulkan), see `hearth doctor`"
    return asked, None


class BufferLog:
    """Sizes of the buffers llama.cpp reports allocating, per buffer type (Vulkan0, CPU_Mapped, ...) and part."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sizes: dict[tuple[str, str], int] = {}
        self.offloaded: tuple[int, int] | None = None  # (layers on the GPU, layers) from the last load's line

    def feed(self, line: str) -> None:
        """Take one llama.cpp log line (those that are not buffer sizes are ignored)."""
        offload = _OFFLOAD_LINE.search(line)
        if offload:
            self.offloaded = (int(offload.group(1)), int(offload.group(2)))
        match = _BUFFER_LINE.search(line)
        if match:
            with self._lock:
                key = (match.group(1), match.group(2))
                self._sizes[key] = self._sizes.get(key, 0) + round(float(match.group(3)) * _MIB)

    def clear(self) -> None:
        """Forget what was counted (before the next load in this process)."""
        with self._lock:
            self._sizes.clear()
            self.offloaded = None

    def by_buffer(self) -> dict[str, dict[str, int]]:
        """{buffer type: {part: bytes}} as logged since the last clear."""
        with self._lock:
            out: dict[str, dict[str, int]] = {}
            for (buffer, part), size in self._sizes.items():
                out.setdefault(buffer, {})[part] = size
            return out

    def device_bytes(self, device: str) -> int:
        """Bytes llama.cpp allocated on one device's own buffers (model, KV, compute, ...)."""
        return sum(self.by_buffer().get(device, {}).values())


def main() -> int:
    """Print this process's devices as JSON (one object per device, app.devices.Device's fields)."""
    json.dump([asdict(d) for d in list_devices()], sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
