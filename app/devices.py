"""The one place Hearth describes compute devices: what llama.cpp's backends see (CPU, Vulkan, CUDA, ...).

A `Device` is llama.cpp's view of one device (`ggml_backend_dev_*`): the runner flags that place work
(`-ngl`, `--device`, `--tensor-split`, `--main-gpu`), the memory budget per device, the fit and the
dashboard all speak of devices by this record's `name` ("Vulkan0", "CUDA0"), as llama-server does.
How the list is read on a live box (a probe of the backends llama.cpp carries, NVML, DRM/sysfs) is
built beside this record; placement and fit are pure functions of a list of them, so tests pass
made-up devices (two GPUs on a box with none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# llama.cpp's enum ggml_backend_dev_type, spelled as words: "cpu" (a CPU backend), "gpu" (a discrete or
# software GPU), "igpu" (an integrated GPU sharing host memory), "accel" (BLAS-like accelerators).
DeviceKind = Literal["cpu", "gpu", "igpu", "accel"]


@dataclass(frozen=True)
class Device:
    """One device as llama.cpp's backend registry reports it."""

    name: str  # llama.cpp's device name, the one its flags take: "Vulkan0", "CUDA0", "CPU"
    backend: str  # the backend that drives it: "Vulkan", "CUDA", "CPU"
    kind: DeviceKind
    description: str  # what the driver calls it: "Intel(R) UHD Graphics 770", "llvmpipe (LLVM 15.0.6)"
    total_bytes: int
    free_bytes: int
    # False where the driver reports a fixed free figure whatever is allocated (Mesa's lavapipe: 2048/2048
    # MiB always): memory in use there is counted from llama.cpp's own buffer sizes instead.
    reports_usage: bool = True
    # The largest single tensor the device may hold (Vulkan's maxStorageBufferRange: 128 MiB on lavapipe); None: no
    # limit known. llama.cpp keeps a tied output matrix larger than this in RAM instead of copying it here.
    max_tensor_bytes: int | None = None

    @property
    def is_gpu(self) -> bool:
        """Whether layers offloaded with -ngl can land here."""
        return self.kind in ("gpu", "igpu")
