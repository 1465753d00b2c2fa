"""app.engine.backends: the devices llama.cpp sees, its buffer sizes, flash attention on lavapipe."""

from app.device_probe import is_software_vulkan
from app.devices import Device
from app.engine.backends import BufferLog, flash_attn_for, list_devices

LAVAPIPE = Device("Vulkan0", "Vulkan", "igpu", "llvmpipe (LLVM 15.0.6, 256 bits)", 2 << 30, 2 << 30, False)
INTEL = Device("Vulkan0", "Vulkan", "igpu", "Intel(R) UHD Graphics 770 (ADL-S GT1)", 16 << 30, 12 << 30)


def test_this_box_lists_its_cpu_device_from_llama_cpp():
    devices = list_devices()
    cpu = [d for d in devices if d.backend == "CPU"]
    assert len(cpu) == 1 and cpu[0].name == "CPU" and cpu[0].kind == "cpu" and not cpu[0].is_gpu
    assert cpu[0].total_bytes > 0 and not cpu[0].reports_usage


def test_buffer_log_counts_what_llama_cpp_reports_per_device_and_part():
    log = BufferLog()
    for line in ("load_tensors: offloaded 3/3 layers to GPU",
                 "load_tensors:      Vulkan0 model buffer size =    65.00 MiB",
                 "load_tensors:   CPU_Mapped model buffer size =     0.50 MiB",
                 "llama_kv_cache:    Vulkan0 KV buffer size =    21.00 MiB",
                 "llama_context:    Vulkan0 compute buffer size =    19.25 MiB",
                 "llama_context: Vulkan_Host compute buffer size =     1.00 MiB",
                 "llama_context: n_ctx = 1024"):
        log.feed(line)
    assert log.by_buffer()["Vulkan0"] == {"model": 65 << 20, "KV": 21 << 20, "compute": round(19.25 * (1 << 20))}
    assert log.device_bytes("Vulkan0") == (65 + 21) * (1 << 20) + round(19.25 * (1 << 20))
    assert log.device_bytes("CUDA0") == 0 and log.offloaded == (3, 3)
    log.clear()
    assert log.by_buffer() == {} and log.offloaded is None


def test_flash_attention_auto_is_off_when_layers_go_to_lavapipe_only():
    assert flash_attn_for([LAVAPIPE], 99, "auto")[0] == "off"
    assert "lavapipe" in flash_attn_for([LAVAPIPE], 99, "auto")[1]
    # Nothing offloaded, a real GPU, or asked explicitly: the asked setting stands.
    assert flash_attn_for([LAVAPIPE], 99, "on") == ("on", None)
    assert flash_attn_for([LAVAPIPE], 0, "auto") == ("auto", None)
    assert flash_attn_for([INTEL], 99, "auto") == ("auto", None)
    assert flash_attn_for([LAVAPIPE], 99, "off") == ("off", None)
    assert is_software_vulkan(LAVAPIPE.description) and not is_software_vulkan(INTEL.description)
