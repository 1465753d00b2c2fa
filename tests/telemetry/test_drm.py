"""app.telemetry.drm against fake sysfs and fdinfo trees: amdgpu's files, i915's and xe's fdinfo."""

import os
from pathlib import Path
from types import SimpleNamespace

from app.telemetry.drm import DrmSampler, list_cards
from app.telemetry.sampler import Sampler

GIB = 1 << 30


def card(sys_root, n, pdev, driver, files=None):
    """/sys/class/drm/card<n> -> the PCI device, whose driver link names the kernel driver."""
    device = sys_root / "devices" / "pci0000:00" / pdev
    device.mkdir(parents=True)
    (sys_root / "bus" / "pci" / "drivers" / driver).mkdir(parents=True, exist_ok=True)
    os.symlink(sys_root / "bus" / "pci" / "drivers" / driver, device / "driver")
    for name, value in (files or {}).items():
        (device / name).write_text(f"{value}\n")
    drm = sys_root / "class" / "drm" / f"card{n}"
    drm.mkdir(parents=True)
    os.symlink(device, drm / "device")
    (sys_root / "class" / "drm" / f"renderD{128 + n}").mkdir()


def client(proc_root, pid, fd, text):
    fdinfo = proc_root / str(pid) / "fdinfo"
    fdinfo.mkdir(parents=True, exist_ok=True)
    (fdinfo / str(fd)).write_text(text)


def i915_fdinfo(client_id, render_ns, resident_kib):
    return ("pos:\t0\nflags:\t02100002\ndrm-driver:\ti915\ndrm-pdev:\t0000:00:02.0\n"
            f"drm-client-id:\t{client_id}\ndrm-engine-render:\t{render_ns} ns\ndrm-engine-copy:\t0 ns\n"
            f"drm-engine-capacity-video:\t2\ndrm-total-system0:\t{resident_kib * 2} KiB\n"
            f"drm-resident-system0:\t{resident_kib} KiB\n")


def test_amdgpu_reads_vram_and_busy_percent_from_sysfs(tmp_path):
    card(tmp_path / "sys", 1, "0000:03:00.0", "amdgpu",
         {"mem_info_vram_total": 8 * GIB, "mem_info_vram_used": GIB, "gpu_busy_percent": 37})
    card(tmp_path / "sys", 0, "0000:01:00.0", "nvidia")  # NVML's, not read here
    assert [c.driver for c in list_cards(tmp_path / "sys")] == ["amdgpu"]
    readings = DrmSampler(tmp_path / "sys", tmp_path / "proc").sample(100.0)
    assert sorted(readings) == [("gpu:0", "gpu_util_pct", 37.0), ("gpu:0", "vram_total_bytes", 8.0 * GIB),
                                ("gpu:0", "vram_used_bytes", 1.0 * GIB)]


def test_i915_utilisation_is_the_busiest_engines_time_over_its_clients(tmp_path):
    sys_root, proc = tmp_path / "sys", tmp_path / "proc"
    card(sys_root, 0, "0000:00:02.0", "i915")
    client(proc, 10, 5, i915_fdinfo(7, 1_000_000_000, 1024))
    client(proc, 10, 6, i915_fdinfo(7, 1_000_000_000, 1024))  # the same client through a second fd
    client(proc, 11, 3, "pos:\t0\nflags:\t0\n")  # not a DRM file
    drm = DrmSampler(sys_root, proc)
    first = dict(((s, m), v) for s, m, v in drm.sample(100.0))
    assert first == {("gpu:0", "vram_used_bytes"): 1024 * 1024.0}  # a rate needs two samples
    client(proc, 10, 5, i915_fdinfo(7, 1_250_000_000, 2048))
    client(proc, 10, 6, i915_fdinfo(7, 1_250_000_000, 2048))
    client(proc, 12, 4, i915_fdinfo(9, 250_000_000, 1024))  # a new client: all its time is since the last sample
    later = dict(((s, m), v) for s, m, v in drm.sample(101.0))
    assert later[("gpu:0", "gpu_util_pct")] == 50.0
    assert later[("gpu:0", "vram_used_bytes")] == 3 * 1024 * 1024.0


def test_xe_utilisation_is_cycles_over_the_gpu_timestamp(tmp_path):
    sys_root, proc = tmp_path / "sys", tmp_path / "proc"
    card(sys_root, 0, "0000:00:02.0", "xe")

    def xe(cycles, total):
        return (f"drm-driver:\txe\ndrm-pdev:\t0000:00:02.0\ndrm-client-id:\t3\ndrm-cycles-rcs:\t{cycles}\n"
                f"drm-total-cycles-rcs:\t{total}\ndrm-cycles-bcs:\t0\ndrm-total-cycles-bcs:\t{total}\n"
                "drm-resident-vram0:\t4 MiB\n")

    client(proc, 20, 3, xe(1000, 10_000))
    drm = DrmSampler(sys_root, proc)
    drm.sample(5.0)
    client(proc, 20, 3, xe(1750, 11_000))
    readings = dict(((s, m), v) for s, m, v in drm.sample(6.0))
    assert readings[("gpu:0", "gpu_util_pct")] == 75.0 and readings[("gpu:0", "vram_used_bytes")] == 4 * 1024 * 1024.0


def test_no_drm_cards_means_no_readings(tmp_path):
    assert DrmSampler(tmp_path / "sys", tmp_path / "proc").sample(1.0) == []


def test_the_sampler_feeds_the_gpu_series_from_drm_where_nvml_has_no_gpu(tmp_path):
    card(tmp_path / "sys", 0, "0000:03:00.0", "amdgpu", {"mem_info_vram_total": GIB, "mem_info_vram_used": 0})
    sampler = Sampler(SimpleNamespace(submit=lambda job: None), lambda: [], lambda: {}, clock=lambda: 5.0,
                      nvml=SimpleNamespace(nvmlDeviceGetCount=lambda: 0),
                      drm=DrmSampler(tmp_path / "sys", tmp_path / "proc"))
    sampler.sample_all()
    assert sampler.latest["gpu:0"] == {"vram_total_bytes": float(GIB), "vram_used_bytes": 0.0}


def test_without_driver_readings_the_gpu_series_come_from_the_runners_device_buffers(monkeypatch):
    from app import device_probe
    from app.devices import Device
    from app.residency.manager import ModelState

    probe = device_probe.Probe("vulkan", devices=(Device("Vulkan0", "Vulkan", "gpu", "llvmpipe", 2 * GIB, 2 * GIB,
                                                         False),))
    monkeypatch.setattr(device_probe, "_cached", (0.0, probe))
    text = ('# TYPE hearth:device_buffer_bytes gauge\nhearth:device_buffer_bytes{device="Vulkan0"} 6000000\n')
    runners = [{"name": m, "state": ModelState.READY, "nodes": [{"healthy": True, "url": f"http://{m}", "label": "local"}]}
               for m in ("a", "b")]
    sampler = Sampler(SimpleNamespace(submit=lambda job: None), lambda: runners, lambda: {}, clock=lambda: 5.0,
                      http_get=lambda url, timeout: text if url.endswith("/metrics") else "[]",
                      nvml=SimpleNamespace(nvmlDeviceGetCount=lambda: 0), drm=DrmSampler(Path("/nonexistent"), Path("/nonexistent")))
    sampler.sample_all()
    assert sampler.latest["gpu:0"] == {"vram_used_bytes": 12e6, "vram_total_bytes": float(2 * GIB)}
