"""The Models page in a real browser: a load taken apart as a stacked bar (with its first prefill once a request
came), the page-cache share, and the weights choice saved through htmx and kept across a reload."""

import sqlite3

from tests.browser.conftest import shot

MODEL = "gemma-3-270m-q4_k_m"


def test_a_loads_split_and_the_weights_choice_on_the_models_page(page, served):
    page.set_default_timeout(90_000)  # the shared 2-core test box can be very loaded
    # A load of this test's own, whose first request is the one below: the session's other tests have loaded the
    # model before, and their first requests need not have finished (a cancelled stream completes no split).
    page.goto("/models")
    card = page.locator(f"#model-{MODEL}")
    if card.locator("button", has_text="Unload").count():
        card.locator("button", has_text="Unload").click()
        page.wait_for_selector(f"#model-{MODEL}[data-state=unloaded]")
    r = served.client.post("/v1/completions", headers={"Authorization": f"Bearer {served.token}"},
                           json={"model": MODEL, "prompt": "Hello", "max_tokens": 2}, timeout=180)
    assert r.status_code == 200, r.text
    page.goto("/models")
    card = page.locator(f"#model-{MODEL}")
    # The first request's prefill is written after the load's row: reload until the newest bar has it (an
    # older load's bar may have one already).
    for _ in range(60):
        if card.locator(".load-split").first.locator(".load-part-prefill").count():
            break
        page.wait_for_timeout(500)
        page.reload()
    bar = card.locator(".load-split").first
    assert bar.locator(".load-part-read").count() == 1 and bar.locator(".load-part-context").count() == 1
    assert bar.locator(".load-part-prefill").count() == 1 and bar.locator(".load-part-upload").count() == 0
    label = bar.locator(".load-bar").get_attribute("aria-label")
    assert "weights read" in label and ("from page cache" in label or "from disk" in label)
    # The parts are drawn on one scale: the longest load's bar fills it (not necessarily the newest one).
    filled = [sum(el.bounding_box()["width"] for el in b.locator(".load-bar > span").all())
              / b.locator(".load-bar").bounding_box()["width"] for b in card.locator(".load-split").all()]
    assert max(filled) > 0.95 and all(0 < f <= 1.01 for f in filled), filled
    assert "in page cache:" in card.locator(".weights-cache").inner_text()
    shot(page, "models-load-split")

    form = card.locator("form.weights-form")
    form.locator("select[name=weights]").select_option("cold")
    form.locator("button[type=submit]").click()
    page.locator(f"#model-{MODEL} >> text=Saved: weights cold.").wait_for()
    page.reload()
    assert page.locator(f"#model-{MODEL} select[name=weights]").input_value() == "cold"
    with sqlite3.connect(served.data / "hearth.db") as db:
        assert db.execute("SELECT r.weights FROM runner_settings r JOIN models m ON m.id = r.model_id "
                          "WHERE m.name = ?", (MODEL,)).fetchall() == [("cold",)]
    # Back to the default for the session's other tests.
    form = page.locator(f"#model-{MODEL} form.weights-form")
    form.locator("select[name=weights]").select_option("warm")
    form.locator("button[type=submit]").click()
    page.locator(f"#model-{MODEL} >> text=Saved: weights warm.").wait_for()
