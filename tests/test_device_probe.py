"""app.device_probe: the devices a runner would see, read in a child process."""

import sys

import pytest

from app.device_probe import probe_devices
from app.llama_tools import llama_lib_env


def test_cpu_build_probe_names_the_cpu_device_and_sets_no_library_path():
    probe = probe_devices({"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert probe.error is None and probe.backend == "cpu"
    assert [d.name for d in probe.devices if d.backend == "CPU"] == ["CPU"]
    assert llama_lib_env({}) == {}


def test_vulkan_without_its_build_says_how_to_build_it(tmp_path):
    env = {"HEARTH_LLAMA_BACKEND": "vulkan", "HEARTH_TOOLS_CACHE": str(tmp_path)}
    probe = probe_devices(env)
    assert probe.devices == () and "build_llama_tools.sh --vulkan" in probe.error


def test_unknown_backend_is_refused_with_the_choices():
    probe = probe_devices({"HEARTH_LLAMA_BACKEND": "metal"})
    assert "choose one of cpu, vulkan" in probe.error


def test_a_named_library_folder_is_what_the_runner_loads(tmp_path):
    (tmp_path / "libllama.so").write_bytes(b"")
    env = llama_lib_env({"HEARTH_LLAMA_BACKEND": "Vulkan", "HEARTH_LLAMA_LIB_DIR": str(tmp_path)})
    assert env == {"LLAMA_CPP_LIB_PATH": str(tmp_path), "MTMD_CPP_LIB": str(tmp_path)}


def test_the_cpu_build_starts_no_probe_for_the_budget(monkeypatch):
    from app.services import settings

    monkeypatch.delenv("HEARTH_LLAMA_BACKEND", raising=False)
    monkeypatch.setattr(settings, "cached_probe", lambda: (_ for _ in ()).throw(AssertionError("probed")))
    assert settings.offload_devices() == ()


def test_a_runner_with_layers_on_lavapipe_is_estimated_without_flash_attention(monkeypatch):
    from app.devices import Device
    from app.services import settings

    lavapipe = Device("Vulkan0", "Vulkan", "gpu", "llvmpipe (LLVM 15.0.6, 256 bits)", 2 << 30, 2 << 30, False)
    monkeypatch.setattr(settings, "offload_devices", lambda: (lavapipe,))
    assert not settings.flash_attn_possible(99) and settings.flash_attn_possible(0)
    monkeypatch.setattr(settings, "offload_devices", lambda: ())
    assert settings.flash_attn_possible(99)


def test_runner_list_devices_prints_none_on_a_cpu_build(capsys, monkeypatch):
    from app.cli import main

    monkeypatch.delenv("HEARTH_LLAMA_BACKEND", raising=False)
    assert main(["runner", "--list-devices"]) == 0
    assert capsys.readouterr().out == "Available devices:\n  (none)\n"


def test_a_cpu_lib_dir_is_used_when_it_holds_a_build_and_the_wheel_otherwise(tmp_path):
    from app.llama_tools import LlamaToolsNotFound, backend_modules, llama_lib_env

    env = {"HEARTH_LLAMA_LIB_DIR": str(tmp_path / "llama-lib")}
    assert llama_lib_env(env) == {}  # missing: the wheel's libraries
    (tmp_path / "llama-lib").mkdir()
    assert llama_lib_env(env) == {}  # empty (an image built without CPU_VARIANTS=all): the wheel's
    (tmp_path / "llama-lib" / "libggml-cpu-haswell.so").write_bytes(b"")
    with pytest.raises(LlamaToolsNotFound, match="no libllama.so"):
        llama_lib_env(env)
    (tmp_path / "llama-lib" / "libllama.so").write_bytes(b"")
    assert llama_lib_env(env)["LLAMA_CPP_LIB_PATH"] == str(tmp_path / "llama-lib")
    assert backend_modules(tmp_path / "llama-lib") == ["libggml-cpu-haswell.so"] and backend_modules(None) == []
