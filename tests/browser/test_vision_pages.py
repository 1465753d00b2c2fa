"""Vision on the dashboard in a real browser against a real `hearth serve` whose models folder pairs a random
projector with a copy of Gemma: the Models page names the capability and the projector, the Requests page shows
an image request's image count and the encode time the runner measured."""

from __future__ import annotations

import shutil
import time

import pytest

from app.devtools.mmproj import cached_mmproj
from tests.browser.conftest import CHROMIUM, shot
from tests.helpers import setup_code
from tests.images import data_url, image_bytes, image_message

VISION = "gemma-vision-Q4_K_M"
PASSWORD = "vision browser password"


@pytest.fixture(scope="module")
def vserved(start_shared_serve, tmp_path_factory, gemma_path):
    models = tmp_path_factory.mktemp("vision-browser-models")
    shutil.copyfile(gemma_path, models / f"{VISION}.gguf")
    shutil.copyfile(cached_mmproj(gemma_path), models / "mmproj-gemma-vision-f32.gguf")
    s = start_shared_serve(models=models, settings={"runner_ctx": 1024, "runner_parallel": 2, "runner_threads": 2})
    yield s
    s.stop()


@pytest.fixture()
def vpage(browser, vserved):
    context = browser.new_context(viewport={"width": 1280, "height": 900}, base_url=vserved.url)
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(90_000)
    page.goto("/setup")
    page.fill("input[name=setup_code]", setup_code(vserved.data))
    page.fill("input[name=password]", PASSWORD)
    page.fill("input[name=confirm]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(vserved.url + "/")
    yield page
    context.close()
    assert not errors, errors


def test_models_and_requests_pages_show_vision(vpage, vserved):
    assert CHROMIUM.exists()
    r = vserved.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {vserved.tokens['alice']}"},
                            json={"model": VISION, "max_tokens": 2, "temperature": 0,
                                  "messages": [image_message("What is this?", data_url(image_bytes(seed=31)))]})
    assert r.status_code == 200, r.text
    encode_ms = r.json()["timings"]["image_encode_ms"]

    vpage.goto("/models")
    card = vpage.locator("article.model-card", has=vpage.locator("h2", has_text=VISION))
    assert card.locator(".vision .badge", has_text="vision").count() == 1
    assert "mmproj-gemma-vision-f32.gguf" in card.locator(".vision code").inner_text()
    assert card.locator("table.estimate td", has_text="Vision projector (weights + image compute)").count() == 1
    shot(vpage, "models-vision")

    deadline = time.monotonic() + 60
    while True:  # the row reaches the store through the writer thread
        vpage.goto(f"/requests?model={VISION}")
        if vpage.locator(".images").count() or time.monotonic() > deadline:
            break
    line = vpage.locator(".images").first
    assert line.inner_text().startswith("1 image")
    assert line.locator(".image-encode-ms").inner_text() == f"{encode_ms:,.1f}"
    shot(vpage, "requests-images")
