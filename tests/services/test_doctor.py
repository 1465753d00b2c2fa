"""app.services.doctor (`hearth doctor`): the box explained, on this CPU-only box and with a fake Intel GPU."""

import sys
from types import SimpleNamespace

from app.cli import main
from app.services.doctor import examine, render
from tests.telemetry.test_drm import card

NO_NVIDIA = SimpleNamespace(nvmlDeviceGetCount=lambda: 0)


def env(**extra):
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), **extra}


def test_a_cpu_only_box_names_its_cpu_device_and_keeps_the_ram_budget(tmp_path):
    report = examine(env(), nvml=NO_NVIDIA, sys_root=tmp_path / "sys", proc_root=tmp_path / "proc")
    assert [d["name"] for d in report["devices"]] == ["CPU"]
    assert report["budget"]["kind"] == "ram" and report["build"]["backend"] == "cpu"
    text = render(report)
    assert "CPU        CPU     cpu" in text and "no GPU: models run on the CPU" in text


def test_an_intel_gpu_with_the_cpu_build_says_how_to_use_it(tmp_path):
    card(tmp_path / "sys", 0, "0000:00:02.0", "i915")
    report = examine(env(), nvml=NO_NVIDIA, sys_root=tmp_path / "sys", proc_root=tmp_path / "proc")
    assert report["drm"]["cards"] == [{"card": "card0", "driver": "i915", "pdev": "0000:00:02.0"}]
    assert any("HEARTH_LLAMA_BACKEND=vulkan" in note for note in report["advice"])


def test_a_vulkan_build_that_is_missing_is_explained(tmp_path):
    report = examine(env(HEARTH_LLAMA_BACKEND="vulkan", HEARTH_TOOLS_CACHE=str(tmp_path)), nvml=NO_NVIDIA,
                     sys_root=tmp_path / "sys", proc_root=tmp_path / "proc")
    assert report["devices"] == [] and "--vulkan" in report["probe_error"]
    assert "the device probe failed" in render(report)


def test_the_doctor_command_prints_the_report(capsys):
    assert main(["doctor", "--json"]) == 0
    assert '"devices"' in capsys.readouterr().out
