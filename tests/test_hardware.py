"""NVML opened through one place: init failures, "no GPU" kept quiet, other failures warned about once."""

from types import SimpleNamespace

import pytest

from app import hardware


@pytest.fixture(autouse=True)
def fresh_reports(monkeypatch):
    """NVML failures are logged once per process: each test starts with none reported."""
    monkeypatch.setattr(hardware, "_reported", set())


def nvml_failing_init(message):
    def init():
        raise RuntimeError(message)

    return SimpleNamespace(nvmlInit=init)


@pytest.mark.parametrize(("message", "level"), [
    ("NVML Shared Library Not Found", "INFO"),  # no driver installed: a CPU-only NAS
    ("Driver Not Loaded", "INFO"),
    ("Insufficient Permissions", "WARNING"),  # a container without the device nodes
    ("Driver/library version mismatch", "WARNING"),  # the driver was upgraded without a reboot
])
def test_init_failures_give_no_gpu_and_only_real_problems_warn(message, level, caplog):
    with caplog.at_level("INFO", logger="app.hardware"):
        assert hardware.init_nvml(nvml_failing_init(message)) is None
    assert [(r.levelname, message in r.getMessage()) for r in caplog.records] == [(level, True)]


def test_a_repeated_failure_is_logged_once(caplog):
    with caplog.at_level("INFO", logger="app.hardware"):
        for _ in range(3):
            hardware.report_nvml_error("NVML lists no devices", RuntimeError("Unknown Error"))
        hardware.report_nvml_error("NVML lists no devices", RuntimeError("GPU is lost"))
    assert [r.getMessage() for r in caplog.records] == ["NVML lists no devices: Unknown Error",
                                                        "NVML lists no devices: GPU is lost"]


def test_gpus_and_their_memory_from_an_opened_nvml():
    nvml = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        # Older bindings return bytes.
        nvmlDeviceGetName=lambda h: b"NVIDIA L4" if h == "h1" else "NVIDIA H200",
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=100, free=60 if h == "h0" else 10),
    )
    assert hardware.init_nvml(nvml) is nvml
    assert hardware.nvml_gpus(nvml) == (nvml, ["h0", "h1"])
    gpus, note = hardware.gpu_memory(nvml)
    assert gpus == [hardware.GpuMemory("NVIDIA H200", 100, 60), hardware.GpuMemory("NVIDIA L4", 100, 10)]
    assert note == "VRAM of 2 NVIDIA GPU(s) via NVML"


def test_no_devices_is_none():
    assert hardware.nvml_gpus(SimpleNamespace(nvmlDeviceGetCount=lambda: 0)) is None
    assert hardware.gpu_memory(SimpleNamespace(nvmlDeviceGetCount=lambda: 0))[0] == []


def test_this_machine_is_described():
    described = hardware.machine()
    assert described["cores"] >= 1 and described["ram_bytes"] > 0
    assert described["gpu"] is None or all(isinstance(name, str) for name in described["gpu"])
