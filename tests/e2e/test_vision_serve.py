"""A vision model through `hearth serve`: a projector beside the model in the models folder is paired by name,
its runner started with --mmproj, /api/show lists `vision`, and images arrive through the gateway's APIs
(Ollama's official client, OpenAI chat, Anthropic messages); a model without one answers what to add."""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
import shutil
import threading
import time
from wsgiref.simple_server import make_server

import httpx
import numpy as np
import ollama
import pytest
from PIL import Image

from app.devtools.mmproj import cached_mmproj
from app.protocols.openai import MAX_GENERATION_BODY_BYTES, MAX_IMAGE_BYTES
from tests.helpers import setup_code
from tests.images import data_url, image_bytes, image_message

VISION = "gemma-vision-Q4_K_M"
QUESTION = "Describe this picture in one sentence."
ADMIN_PASSWORD = "vision admin password"
CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
# The Requests page's images line: the count and the encode time, as _log.html writes them.
IMAGES_CELL = re.compile(r'class="small muted images"[^>]*>(\d+) images? · <span class="image-encode-ms">([\d.,]+)</span>')


@pytest.fixture(scope="module")
def vserve(start_shared_serve, tmp_path_factory, gemma_path):
    """A serve whose models folder holds a copy of Gemma and the random projector named after it."""
    models = tmp_path_factory.mktemp("vision-models")
    # A copy, not a link: the catalog lists one file once, however many names it has.
    shutil.copyfile(gemma_path, models / f"{VISION}.gguf")
    shutil.copyfile(cached_mmproj(gemma_path), models / "mmproj-gemma-vision-f32.gguf")
    return start_shared_serve(models=models)


@pytest.fixture()
def client(vserve):
    c = ollama.Client(host=vserve.url, headers={"Authorization": f"Bearer {vserve.tokens['alice']}"})
    yield c
    c.close()


def test_show_lists_vision_only_for_the_paired_model(client):
    assert "vision" in client.show(VISION).capabilities
    assert "vision" not in client.show("gemma-3-270m-q4_k_m").capabilities


def test_ollama_images_are_answered_and_counted_in_the_prompt(client):
    png = image_bytes(seed=7)
    with_image = client.chat(model=VISION, messages=[{"role": "user", "content": QUESTION, "images": [png]}],
                             options={"num_predict": 4, "temperature": 0})
    text_only = client.chat(model=VISION, messages=[{"role": "user", "content": QUESTION}],
                            options={"num_predict": 4, "temperature": 0})
    assert with_image.prompt_eval_count >= text_only.prompt_eval_count + 16
    generated = client.generate(model=VISION, prompt=QUESTION, images=[base64.b64encode(png).decode()],
                                options={"num_predict": 4, "temperature": 0})
    assert generated.eval_count > 0


def test_openai_and_anthropic_images_through_the_gateway(vserve):
    headers = {"Authorization": f"Bearer {vserve.tokens['alice']}"}
    png = image_bytes(seed=8)
    r = vserve.client.post("/v1/chat/completions", headers=headers, json={
        "model": VISION, "max_tokens": 4, "temperature": 0, "messages": [image_message(QUESTION, data_url(png))]})
    assert r.status_code == 200, r.text
    m = vserve.client.post("/v1/messages", headers=headers, json={
        "model": VISION, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png).decode()}}]}]})
    assert m.status_code == 200, m.text
    # The same model without a projector says what to add, and keeps serving.
    bad = vserve.client.post("/v1/chat/completions", headers=headers, json={
        "model": "gemma-3-270m-q4_k_m", "max_tokens": 4, "messages": [image_message(QUESTION, data_url(png))]})
    assert bad.status_code == 400 and "--mmproj" in bad.json()["error"]["message"]


@pytest.fixture()
def admin(vserve):
    """An httpx client logged in to the serve's dashboard (its first-run /setup done with the setup code)."""
    with httpx.Client(base_url=vserve.url, timeout=60) as c:
        page = c.get("/setup", follow_redirects=True).text
        if 'name="setup_code"' in page:
            token = CSRF.search(page).group(1)
            r = c.post("/setup", data={"password": ADMIN_PASSWORD, "confirm": ADMIN_PASSWORD, "csrf_token": token,
                                       "setup_code": setup_code(vserve.data)})
        else:  # set up already by another test of the module: log in
            token = CSRF.search(c.get("/login").text).group(1)
            r = c.post("/login", data={"password": ADMIN_PASSWORD, "csrf_token": token})
        assert r.status_code == 302, r.text
        yield c


def _metric(text: str, name: str, klass: str) -> float:
    """One sample of serve's /metrics for a class (0 when absent)."""
    m = re.search(rf'^{re.escape(name)}{{class="{klass}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_the_requests_page_and_metrics_show_the_runners_encode_time(vserve, admin):
    # Class voice (alice may ask for it): the other tests here send chat, so the row and the metrics are this one's.
    headers = {"Authorization": f"Bearer {vserve.tokens['alice']}", "X-Hearth-Class": "voice"}
    before = vserve.client.get("/metrics").text
    png = image_bytes(seed=21, size=(96, 64))
    question = "What colour dominates this picture?"
    t0 = time.perf_counter()
    r = vserve.client.post("/v1/chat/completions", headers=headers, json={
        "model": VISION, "max_tokens": 3, "temperature": 0,
        "messages": [image_message(question, data_url(png))]})
    stopwatch_ms = (time.perf_counter() - t0) * 1000
    assert r.status_code == 200, r.text
    runner = r.json()["timings"]
    assert runner["num_images"] == 1 and runner["image_encode_ms"] > 0
    assert runner["image_encode_ms"] <= stopwatch_ms

    shown = None
    deadline = time.monotonic() + 30
    while shown is None and time.monotonic() < deadline:  # the row reaches the store through the writer thread
        page = admin.get("/requests", params={"model": VISION, "class": "voice"}).text
        shown = IMAGES_CELL.search(page)
    assert shown is not None, "no row with an image on the Requests page"
    assert shown.group(1) == "1"
    assert shown.group(2) == f"{runner['image_encode_ms']:,.1f}"
    assert float(shown.group(2).replace(",", "")) <= stopwatch_ms

    klass = "voice"
    after = vserve.client.get("/metrics").text
    assert _metric(after, "hearth:gateway_images_total", klass) - _metric(before, "hearth:gateway_images_total",
                                                                          klass) == 1
    encoded_s = (_metric(after, "hearth:gateway_image_encode_seconds_sum", klass)
                 - _metric(before, "hearth:gateway_image_encode_seconds_sum", klass))
    assert encoded_s == pytest.approx(runner["image_encode_ms"] / 1000, rel=1e-6)


def test_a_model_without_a_projector_says_what_to_add_in_every_api(vserve, client):
    headers = {"Authorization": f"Bearer {vserve.tokens['alice']}"}
    text_model = "gemma-3-270m-q4_k_m"
    b64 = base64.b64encode(image_bytes(seed=9)).decode()
    answers = {
        "ollama chat": vserve.client.post("/api/chat", headers=headers, json={
            "model": text_model, "stream": False, "messages": [{"role": "user", "content": QUESTION, "images": [b64]}]}),
        "ollama generate": vserve.client.post("/api/generate", headers=headers, json={
            "model": text_model, "stream": False, "prompt": QUESTION, "images": [b64]}),
        "anthropic": vserve.client.post("/v1/messages", headers=headers, json={
            "model": text_model, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}]}),
        "responses": vserve.client.post("/v1/responses", headers=headers, json={
            "model": text_model, "max_output_tokens": 16, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": QUESTION},
                {"type": "input_image", "image_url": f"data:image/png;base64,{b64}"}]}]}),
    }
    for api, r in answers.items():
        assert r.status_code == 400, (api, r.text)
        body = r.json()
        message = body["error"] if isinstance(body["error"], str) else body["error"]["message"]
        assert "mmproj-<model name>.gguf" in message, (api, message)
    # The model keeps serving text.
    assert client.chat(model=text_model, messages=[{"role": "user", "content": "hi"}],
                       options={"num_predict": 2}).message.content is not None


def _noise_png(side: int) -> bytes:
    """An uncompressed PNG of noise, side × side: 3 bytes a pixel and a little more."""
    pixels = np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", compress_level=0)
    return out.getvalue()


def test_an_image_just_under_the_limit_is_answered_and_one_over_is_a_400_naming_it(vserve):
    headers = {"Authorization": f"Bearer {vserve.tokens['alice']}"}
    under, over = _noise_png(2640), _noise_png(2650)
    assert len(under) < MAX_IMAGE_BYTES < len(over)
    # Base64 of the largest image fits a generation's body: the image limit, not a generic 413, answers.
    assert len(data_url(over)) < MAX_GENERATION_BODY_BYTES
    ok = vserve.client.post("/v1/chat/completions", headers=headers, json={
        "model": VISION, "max_tokens": 2, "temperature": 0, "messages": [image_message(QUESTION, data_url(under))]})
    assert ok.status_code == 200, ok.text[:500]
    assert ok.json()["timings"]["num_images"] == 1
    bad = vserve.client.post("/v1/chat/completions", headers=headers, json={
        "model": VISION, "max_tokens": 2, "messages": [image_message(QUESTION, data_url(over))]})
    assert bad.status_code == 400, bad.text[:500]
    err = bad.json()["error"]
    assert err["code"] == "image_too_large" and f"image limit of {MAX_IMAGE_BYTES:,} bytes" in err["message"]


@pytest.mark.parametrize(("path", "message_at"), [
    ("/v1/chat/completions", ("error", "message")), ("/v1/messages", ("error", "message")),
    ("/v1/responses", ("error", "message")), ("/api/chat", ("error",)), ("/api/generate", ("error",))])
def test_a_body_over_the_generation_limit_is_a_413_in_the_apis_shape(vserve, path, message_at):
    # Only the headers are sent: the limit is checked on the Content-Length, before the body is read.
    conn = http.client.HTTPConnection("127.0.0.1", vserve.port, timeout=30)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Authorization", f"Bearer {vserve.tokens['alice']}")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(MAX_GENERATION_BODY_BYTES + 1))
        conn.endheaders()
        resp = conn.getresponse()
        status, body = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert status == 413
    message = body
    for key in message_at:
        message = message[key]
    assert f"limit of {MAX_GENERATION_BODY_BYTES:,} bytes" in message
    assert f"one image of up to {MAX_IMAGE_BYTES:,} bytes" in message
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large"


def test_an_image_sized_body_is_read_only_for_a_caller_with_a_token(vserve):
    conn = http.client.HTTPConnection("127.0.0.1", vserve.port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(MAX_IMAGE_BYTES))
        conn.endheaders()  # no body follows: the answer comes from the headers alone
        resp = conn.getresponse()
        status, body = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert status == 401 and body["error"]["code"] == "missing_token"


def test_an_image_url_is_refused_at_the_gateway_while_fetching_is_off(vserve):
    """Refused before any runner sees it: a stock llama-server would fetch it, wherever it points."""
    hits = []

    def app(environ, start_response):
        hits.append(environ["PATH_INFO"])
        start_response("200 OK", [("Content-Type", "image/png")])
        return [image_bytes(seed=3)]

    server = make_server("127.0.0.1", 0, app)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/cam.png"
        headers = {"Authorization": f"Bearer {vserve.tokens['alice']}"}
        r = vserve.client.post("/v1/chat/completions", headers=headers, json={
            "model": VISION, "max_tokens": 2, "messages": [image_message(QUESTION, url)]})
        m = vserve.client.post("/v1/responses", headers=headers, json={
            "model": VISION, "max_output_tokens": 16, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": url}]}]})
    finally:
        server.shutdown()
        server.server_close()
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_url_fetch_off"
    assert "runner_image_url_fetch" in r.json()["error"]["message"]
    assert m.status_code == 400 and "runner_image_url_fetch" in m.json()["error"]["message"]
    assert hits == []
