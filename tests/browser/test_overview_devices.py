"""The Overview's memory per device in a real browser, fed by a real runner through serve: the RAM row holds the
loaded model, and its used and budget figures are /metrics' hearth:device_used_bytes and hearth:device_budget_bytes."""

import httpx

from app.exposition import parse_exposition


def test_the_device_block_shows_where_the_model_sits_and_matches_metrics(page, served):
    with httpx.Client(base_url=served.url, timeout=120, headers={"Authorization": f"Bearer {served.token}"}) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        model = r.json()["model"]
        page.goto("/")
        # The block polls every 5 s; the model is resident once the answer came back.
        page.wait_for_function(
            f"() => !!document.querySelector('#overview-device-budget tr[data-device=CPU] [data-model=\"{model}\"]')",
            timeout=30_000)
        row = page.locator("#overview-device-budget tr[data-device=CPU]")
        shown = {"used": int(row.get_attribute("data-used")), "budget": int(row.get_attribute("data-budget"))}
        metrics = parse_exposition(client.get("/metrics").text)
    used = {labels["device"]: v for labels, v in metrics.series("hearth:device_used_bytes")}
    budget = {labels["device"]: v for labels, v in metrics.series("hearth:device_budget_bytes")}
    held = {(labels["model"], labels["device"]): v for labels, v in metrics.series("hearth:model_device_bytes")}
    assert shown == {"used": used["CPU"], "budget": budget["CPU"]} and used["CPU"] > 0
    assert held[(model, "CPU")] > 0
    assert "RAM" in row.inner_text() and model in row.inner_text()
