"""The Overview's memory per device: the partial htmx polls names RAM with its budget (the store's memory limit),
and with made-up devices the residency counts each GPU as a budget of its own."""

from __future__ import annotations

from app.gateway.context import services


def test_the_partial_shows_ram_with_its_budget(app, admin):
    r = admin.get("/partials/overview/devices")
    assert r.status_code == 200
    body = r.get_data(as_text=True)
    budget = services(app).residency.device_status()["CPU"]["budget_bytes"]
    assert f'data-device="CPU" data-used="0" data-budget="{budget}"' in body and "<td>RAM</td>" in body
    assert 'id="overview-device-budget"' in admin.get("/").get_data(as_text=True)


def test_each_gpu_is_a_row_with_the_models_placed_there(app, admin, monkeypatch):
    mib = 1 << 20
    monkeypatch.setattr(services(app).residency, "device_status", lambda: {
        "CPU": {"budget_bytes": 8000 * mib, "used_bytes": 100 * mib, "models": {"gemma": 100 * mib}},
        "Vulkan1": {"budget_bytes": 4000 * mib, "used_bytes": 300 * mib, "models": {"gemma": 300 * mib}}})
    body = admin.get("/partials/overview/devices").get_data(as_text=True)
    assert '<tr data-device="Vulkan1"' in body and 'data-model="gemma"' in body and "<td>Vulkan1</td>" in body
