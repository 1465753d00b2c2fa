"""Tests for app.residency.budget: VRAM via a fake NVML, RAM via psutil and cgroup limits."""

from types import SimpleNamespace

import pytest

from app import hardware
from app.residency.budget import MemoryBudget, detect_budget

MIB = 1024 * 1024
GIB = 1024 * MIB


class FakeNvmlError(Exception):
    """Stands in for pynvml.NVMLError."""


def fake_nvml(gpus=(), query_error=None):
    """A stand-in for the opened pynvml module with the given (name, total, free) GPUs."""
    state = {"queried": False}

    def memory_info(handle):
        state["queried"] = True
        if query_error:
            raise FakeNvmlError(query_error)
        _, total, free = gpus[handle]
        return SimpleNamespace(total=total, free=free, used=total - free)

    return SimpleNamespace(
        NVMLError=FakeNvmlError,
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetName=lambda handle: gpus[handle][0],
        nvmlDeviceGetMemoryInfo=memory_info,
        state=state,
    )


def fake_ram(total, available):
    """A stand-in for psutil.virtual_memory."""
    return lambda: SimpleNamespace(total=total, available=available)


@pytest.fixture
def no_cgroup(tmp_path):
    """A cgroup root with no limit files at all."""
    return tmp_path / "cgroup"


def test_nvidia_gpus_give_a_vram_budget(no_cgroup):
    nvml = fake_nvml([("NVIDIA H200", 140 * GIB, 139 * GIB), (b"NVIDIA L4", 24 * GIB, 20 * GIB)])
    budget = detect_budget(nvml=nvml, cgroup_root=no_cgroup)
    assert budget.kind == "vram"
    assert budget.devices == ("NVIDIA H200", "NVIDIA L4")
    assert budget.total_bytes == 164 * GIB
    assert budget.available_bytes == 159 * GIB
    assert budget.reserve_bytes == int(164 * GIB * 0.10)
    assert budget.usable_bytes == budget.total_bytes - budget.reserve_bytes
    assert "2 NVIDIA GPU(s)" in budget.detail


@pytest.fixture
def fresh_reports(monkeypatch):
    """NVML failures are logged once per process: each test starts with none reported."""
    monkeypatch.setattr(hardware, "_reported", set())


@pytest.mark.parametrize(("nvml", "detail", "warns"), [
    (fake_nvml([]), "no NVIDIA GPU", False),
    (fake_nvml([("GPU", GIB, GIB)], query_error="GPU is lost"), "could not read the GPUs", True),
])
def test_no_usable_nvidia_gpu_is_a_ram_budget(nvml, detail, warns, no_cgroup, caplog, fresh_reports):
    with caplog.at_level("INFO", logger="app.hardware"):
        budget = detect_budget(nvml=nvml, virtual_memory=fake_ram(16 * GIB, 12 * GIB),
                               cgroup_root=no_cgroup)
    assert budget.kind == "ram"
    assert budget.devices == ()
    assert (budget.total_bytes, budget.available_bytes) == (16 * GIB, 12 * GIB)
    assert detail in budget.detail
    # No GPU is a normal state; a GPU NVML cannot read is worth the admin's attention.
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == (["NVML could not read the GPUs' memory: GPU is lost"] if warns else [])


def test_an_nvml_failure_warns_once_not_at_every_load(no_cgroup, caplog, fresh_reports):
    nvml = fake_nvml([("GPU", GIB, GIB)], query_error="Unknown Error")
    with caplog.at_level("INFO", logger="app.hardware"):
        for _ in range(3):
            assert detect_budget(nvml=nvml, virtual_memory=fake_ram(8 * GIB, 6 * GIB), cgroup_root=no_cgroup).kind == "ram"
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_gpu_can_be_declined(no_cgroup):
    nvml = fake_nvml([("NVIDIA H200", 140 * GIB, 139 * GIB)])
    budget = detect_budget(nvml=nvml, use_gpu=False, virtual_memory=fake_ram(8 * GIB, 6 * GIB),
                           cgroup_root=no_cgroup)
    assert budget.kind == "ram"
    assert not nvml.state["queried"]


def test_ram_reserve_is_ten_percent_but_at_least_512_mib(no_cgroup):
    big = detect_budget(nvml=fake_nvml([]), virtual_memory=fake_ram(32 * GIB, 30 * GIB),
                        cgroup_root=no_cgroup)
    assert big.reserve_bytes == int(32 * GIB * 0.10)
    small = detect_budget(nvml=fake_nvml([]), virtual_memory=fake_ram(2 * GIB, GIB),
                          cgroup_root=no_cgroup)
    assert small.reserve_bytes == 512 * MIB
    assert small.usable_bytes == 2 * GIB - 512 * MIB


def test_reserve_and_limit_can_be_configured(no_cgroup):
    budget = detect_budget(reserve_bytes=GIB, limit_bytes=4 * GIB, nvml=fake_nvml([]),
                           virtual_memory=fake_ram(16 * GIB, 10 * GIB), cgroup_root=no_cgroup)
    assert budget.reserve_bytes == GIB
    assert budget.configured_limit_bytes == 4 * GIB
    assert budget.usable_bytes == 4 * GIB
    with pytest.raises(ValueError, match="reserve_bytes"):
        detect_budget(reserve_bytes=-1, nvml=fake_nvml([]))
    with pytest.raises(ValueError, match="limit_bytes"):
        detect_budget(limit_bytes=0, nvml=fake_nvml([]))


def test_container_memory_limit_caps_ram(tmp_path):
    # cgroup v2 at the root of the container's namespace, as Docker mounts it.
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "memory.max").write_text(f"{3 * GIB}\n")
    (root / "memory.current").write_text(f"{GIB}\n")
    budget = detect_budget(nvml=fake_nvml([]), virtual_memory=fake_ram(64 * GIB, 60 * GIB),
                           cgroup_root=root)
    assert budget.total_bytes == 3 * GIB
    assert budget.available_bytes == 2 * GIB
    assert budget.reserve_bytes == 512 * MIB
    assert "cgroup" in budget.detail


def test_unlimited_cgroups_are_ignored(tmp_path):
    root = tmp_path / "cgroup"
    (root / "memory").mkdir(parents=True)
    (root / "memory.max").write_text("max\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    budget = detect_budget(nvml=fake_nvml([]), virtual_memory=fake_ram(8 * GIB, 7 * GIB),
                           cgroup_root=root)
    assert (budget.total_bytes, budget.available_bytes) == (8 * GIB, 7 * GIB)


def test_headroom_respects_the_budget_and_what_is_free_now():
    budget = MemoryBudget(kind="ram", total_bytes=16 * GIB, available_bytes=6 * GIB,
                          reserve_bytes=GIB, usable_bytes=12 * GIB)
    # Other processes took memory: only 6 − 1 GiB may be loaded now, though the budget has 12.
    assert budget.headroom_bytes(0) == 5 * GIB
    assert budget.headroom_bytes(10 * GIB) == 2 * GIB
    assert budget.headroom_bytes(13 * GIB) == 0


def test_real_machine_never_raises():
    budget = detect_budget()
    assert budget.kind in {"ram", "vram"}
    assert 0 < budget.usable_bytes <= budget.total_bytes
    assert budget.detail


def test_vulkan_gpus_give_a_vram_budget_where_nvml_has_none(no_cgroup):
    from app.devices import Device

    devices = (Device("Vulkan0", "Vulkan", "igpu", "Intel(R) UHD Graphics 770", 8 * GIB, 6 * GIB),
               Device("Vulkan1", "Vulkan", "igpu", "llvmpipe (LLVM 15.0.6, 256 bits)", 2 * GIB, 2 * GIB, False),
               Device("CPU", "CPU", "cpu", "AMD EPYC", 64 * GIB, 60 * GIB, False))
    budget = detect_budget(nvml=fake_nvml([]), cgroup_root=no_cgroup, devices=devices)
    assert budget.kind == "vram" and budget.total_bytes == 10 * GIB
    # lavapipe reports no use: its whole heap is free, Hearth's own count of its runners is the limit there.
    assert budget.available_bytes == 8 * GIB
    assert budget.devices == ("Vulkan0 (Intel(R) UHD Graphics 770)", "Vulkan1 (llvmpipe (LLVM 15.0.6, 256 bits))")
    assert "2 Vulkan device(s)" in budget.detail
    # NVIDIA through NVML first; only a CPU device is a RAM budget, as today.
    assert detect_budget(nvml=fake_nvml([("NVIDIA L4", 24 * GIB, 20 * GIB)]), cgroup_root=no_cgroup,
                         devices=devices).devices == ("NVIDIA L4",)
    assert detect_budget(nvml=fake_nvml([]), cgroup_root=no_cgroup, devices=devices[2:],
                         virtual_memory=fake_ram(4 * GIB, 3 * GIB)).kind == "ram"
