"""The Models page in a real browser against a real `hearth serve`: load the model and watch it become resident."""

import re

from tests.browser.conftest import shot


def test_load_a_model_from_the_models_page(page, served):
    page.set_default_timeout(90_000)  # the shared 2-core test box can be very loaded
    page.goto("/models")
    card = page.locator("article.model-card:not(.unusable)").first
    name = card.locator("h2").inner_text()
    assert card.locator("table.estimate >> text=Weights").count() == 1  # the estimate breakdown is shown
    if card.get_attribute("data-state") == "ready":
        # Another test's traffic loaded it already: unload first, through the page.
        card.locator("button", has_text="Unload").click()
        page.wait_for_selector(f"#{card.get_attribute('id')}[data-state=unloaded]", timeout=30_000)
        card = page.locator(f"#{card.get_attribute('id')}")
    shot(page, "models-before-load")
    card_id = card.get_attribute("id")
    card.locator("button", has_text="Load").click()
    # The POST answers with the card in its loading state; the card then polls itself until resident.
    page.wait_for_selector(f"#{card_id}[data-state=loading], #{card_id}[data-state=ready]", timeout=30_000)
    if page.locator(f"#{card_id}[data-state=loading]").count():
        assert page.locator(f"#{card_id} .progress").count() == 1
        shot(page, "models-loading")
    page.wait_for_selector(f"#{card_id}[data-state=ready]", timeout=120_000)
    card = page.locator(f"#{card_id}")
    assert card.get_attribute("hx-trigger") is None  # polling stopped
    assert "Resident\n1" in page.locator("#model-tiles").inner_text()  # tiles swapped out of band
    assert card.locator("button", has_text="Unload").is_visible()
    assert re.search(r"Measured after the last load \(against the [\d.,]+ \w+ of a load: the RAM tier starts empty\)\s+\d",
                     card.inner_text())
    assert "Cold start" in card.inner_text() and "last " in card.inner_text()
    card.locator("summary", has_text="Runner log").click()
    assert card.locator("pre.log-tail").inner_text().strip()
    # The load was recorded: the events table shows it after a refresh.
    page.locator("#residency-events").wait_for()
    page.wait_for_function(
        "name => { const b = document.querySelector('a[hx-get$=\"/models/events\"]'); b.click();"
        " return [...document.querySelectorAll('#residency-events tr')].some(r => r.innerText.includes(name)"
        " && r.innerText.includes('load')); }", arg=name, timeout=30_000, polling=1000)
    shot(page, "models-resident")
    # The gateway agrees: /v1/models reports it ready.
    models = served.client.get("/v1/models", headers={"Authorization": f"Bearer {served.token}"}).json()["data"]
    assert next(m for m in models if m["id"] == name)["hearth"]["state"] == "ready"
