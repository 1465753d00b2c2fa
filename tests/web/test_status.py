"""The phone status page: login unless status_public, content from the latest samples."""

import time

from app.gateway.context import services
from app.store.settings import set_setting
from tests.helpers import wait_until


def make_public(app, value=True):
    hearth = services(app)
    with hearth.sessions() as s:
        set_setting(s, "status_public", value)
        s.commit()
    hearth.settings.invalidate()


def test_status_needs_login_by_default(client, set_up_admin):
    set_up_admin(client)
    assert client.get("/status").status_code == 200
    anonymous = client.application.test_client()
    assert anonymous.get("/status").headers["Location"] == "/login?next=/status"
    assert anonymous.get("/partials/status").status_code == 302


def test_status_public_setting_opens_it(app, client, set_up_admin):
    set_up_admin(app.test_client())
    make_public(app)
    page = client.get("/status")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    assert "Up" in html and 'href="/login"' in html
    # Public status shows no dashboard navigation and no forms.
    assert 'class="nav"' not in html and "Log out" not in html
    assert client.get("/partials/status").status_code == 200
    # The rest of the dashboard stays closed.
    assert client.get("/").status_code == 302


def test_status_content_from_latest_samples(app, admin):
    sampler = services(app).sampler
    sampler.latest = {
        "host": {"cpu_pct": 12.0, "ram_used_bytes": 2 * 1024**3, "ram_total_bytes": 4 * 1024**3},
        "runner:gemma@local": {"gen_tok_s": 88.0, "waiting": 2, "kv_used_pct": 42.0},
    }
    sampler.latest_at = time.time()
    html = admin.get("/partials/status").get_data(as_text=True)
    assert 'hx-trigger="every 2s' in html
    assert "88.0" in html and "42" in html and "2.0 GiB" in html and "no GPU" in html
    assert "status-ok" in html
    # The default model is not loaded: the page says what happens next.
    assert "No model is resident" in html


def test_status_shows_gpu_and_stale_sampler(app, admin):
    sampler = services(app).sampler
    sampler.latest = {"gpu:0": {"gpu_temp_c": 64.0, "vram_used_bytes": 6 * 1024**3, "vram_total_bytes": 24 * 1024**3}}
    sampler.latest_at = time.time() - 60
    html = admin.get("/status").get_data(as_text=True)
    assert "GPU 0" in html and "64" in html and "6.0 GiB / 24.0 GiB" in html
    assert "telemetry stalled" in html and "status-warn" in html


def test_status_names_the_devices_llama_cpp_sees(app, admin, monkeypatch):
    from app import device_probe
    from app.devices import Device

    probe = device_probe.Probe("vulkan", devices=(
        Device("Vulkan0", "Vulkan", "igpu", "llvmpipe (LLVM 15.0.6, 256 bits)", 2 * 1024**3, 2 * 1024**3, False),
        Device("CPU", "CPU", "cpu", "AMD EPYC", 8 * 1024**3, 8 * 1024**3, False)))
    monkeypatch.setattr(device_probe, "_cached", (time.monotonic(), probe))
    html = admin.get("/partials/status").get_data(as_text=True)
    assert "Vulkan0" in html and "llvmpipe (LLVM 15.0.6, 256 bits) · igpu · 2.0 GiB" in html
    assert "AMD EPYC · cpu" in html


def test_status_on_this_box_names_the_cpu_once_the_probe_has_run(app, admin, monkeypatch):
    from app import device_probe

    monkeypatch.setattr(device_probe, "_cached", None)
    admin.get("/partials/status")
    wait_until(device_probe.peek_probe, 60, "the device probe never finished")
    html = admin.get("/partials/status").get_data(as_text=True)
    assert '<span class="status-model-name">CPU</span>' in html and " · cpu" in html
