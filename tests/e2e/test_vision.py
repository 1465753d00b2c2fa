"""Images through a real `hearth runner --mmproj` on the embedded Gemma 3 270M with a random projector, and stock
llama-server with the same model, projector, template and image as the oracle (greedy: same prompt token
count, same generated text)."""

from __future__ import annotations

import io
import time

import pytest
from PIL import Image
from werkzeug.test import Client

from app.devtools.gguf_shapes import CHATML_TEMPLATE
from app.devtools.mmproj import MMPROJ_SHAPES, cached_mmproj
from app.engine.model_config import ModelConfig
from app.runner.app import create_app
from app.runner.config import RunnerConfig
from app.runner.images import as_png
from tests.e2e.test_compat_http import _stock_with_projector
from tests.helpers import metric
from tests.images import MIME, data_url, image_bytes, image_message
from tests.runner.loaded import LOAD_TIMEOUT_S

CHAT = "/v1/chat/completions"
QUESTION = "Describe this picture in one sentence."
N_IMAGE = MMPROJ_SHAPES["mmproj-gemma3-tiny"].n_image_tokens
GREEDY = {"temperature": 0, "max_tokens": 16}


@pytest.fixture(scope="module")
def projector(gemma_path):
    """The random Gemma 3 projector for the embedded model (cached across runs)."""
    return cached_mmproj(gemma_path)


@pytest.fixture(scope="module")
def runner(gemma_path, projector):
    """A runner on the embedded model with the projector, ChatML as llama-server's fallback template."""
    config = RunnerConfig(ModelConfig(path=str(gemma_path), n_ctx=2048, n_seq_max=2, n_threads=2),
                          mmproj=str(projector), chat_template=CHATML_TEMPLATE)
    app = create_app(config)
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while app.state.status == "loading" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert app.state.status == "ok", app.state.error
    yield Client(app)
    app.state.engine.stop()
    app.state.model.close()


def ask(client, image: bytes, mime: str = "image/png", **extra) -> dict:
    r = client.post(CHAT, json={**GREEDY, **extra, "messages": [image_message(QUESTION, data_url(image, mime))]})
    assert r.status_code == 200, r.get_json()
    return r.get_json()


def solid(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 64), color).save(out, format="PNG")
    return out.getvalue()


def test_every_format_is_answered_and_the_prompt_counts_the_images_tokens(runner):
    text_only = runner.post(CHAT, json={**GREEDY, "messages": [{"role": "user", "content": QUESTION}]}).get_json()
    for fmt in ("PNG", "JPEG", "WEBP"):
        answer = ask(runner, image_bytes(fmt, seed=3), MIME[fmt])
        # The image's tokens and its <start_of_image> / <end_of_image> markers.
        assert answer["usage"]["prompt_tokens"] >= text_only["usage"]["prompt_tokens"] + N_IMAGE + 2
        assert answer["usage"]["completion_tokens"] > 0
    # Telemetry: images and their encoding time per class.
    assert metric(runner, 'hearth:images_total{class="default"}') >= 3
    assert metric(runner, 'hearth:image_encode_seconds_total{class="default"}') > 0
    assert metric(runner, "hearth:image_kv_decode_longest_ms") > 0


def test_the_image_decides_the_answer(runner):
    answers = {ask(runner, img)["choices"][0]["message"]["content"]
               for img in (image_bytes(seed=1), image_bytes(seed=2), solid((0, 0, 0)))}
    assert len(answers) > 1  # the embeddings reach the model: different images, different greedy answers


def test_a_follow_up_turn_about_the_same_image_reuses_its_cells(runner):
    image = data_url(image_bytes(seed=5))
    first_turn = [image_message(QUESTION, image)]
    first = runner.post(CHAT, json={**GREEDY, "messages": first_turn}).get_json()
    follow_up = [*first_turn, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And what colour is it mostly?"}]
    second = runner.post(CHAT, json={**GREEDY, "messages": follow_up}).get_json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The whole first prompt, image included, came from the cache: the image was not encoded again.
    assert cached >= first["usage"]["prompt_tokens"]


def test_bad_images_are_400s_and_the_runner_keeps_serving(runner):
    png = image_bytes(seed=6)
    for url, fragment in [(data_url(png[: len(png) // 2]), "truncated"),
                          (data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"), "SVG"),
                          (data_url(b"just text"), "not an image"),
                          ("https://example.invalid/cat.png", "does not fetch")]:
        r = runner.post(CHAT, json={**GREEDY, "messages": [image_message(QUESTION, url)]})
        assert r.status_code == 400 and fragment in r.get_json()["error"]["message"]
    assert ask(runner, png)["usage"]["completion_tokens"] > 0


@pytest.fixture(scope="module")
def stock(gemma_path, projector, tmp_path_factory):
    """Stock llama-server with the same model, projector and template (skipped where it is not built)."""
    yield from _stock_with_projector(gemma_path, projector, tmp_path_factory.mktemp("stock"))


@pytest.mark.parametrize("seed", [1, 3])
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_hearth_answers_as_stock_llama_server_does(runner, stock, fmt, seed):
    image = image_bytes(fmt, seed=seed)
    # No prompt cache on either side: each prompt is computed in the same chunks by both.
    ours = ask(runner, image, MIME[fmt], cache_prompt=False)
    # Stock llama-server decodes with stb_image, which has no WebP: it is given the PNG of the same pixels.
    theirs_image, theirs_mime = (as_png(image), "image/png") if fmt == "WEBP" else (image, MIME[fmt])
    r = stock.post(CHAT, json={**GREEDY, "cache_prompt": False,
                               "messages": [image_message(QUESTION, data_url(theirs_image, theirs_mime))]})
    assert r.status_code == 200, r.text
    theirs = r.json()
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]


def test_stock_llama_server_refuses_webp_which_hearth_takes(stock):
    r = stock.post(CHAT, json={**GREEDY, "messages": [image_message(QUESTION, data_url(image_bytes("WEBP"),
                                                                                        "image/webp"))]})
    assert r.status_code == 400 and "Failed to load image" in r.json()["error"]["message"]


def test_every_api_gives_the_chat_routes_answer_for_the_same_image(runner):
    """Anthropic image blocks, Responses input_image and Ollama's base64 images reach the same prompt as chat."""
    import base64

    from app.protocols.ollama import chat_to_openai

    image = image_bytes("JPEG", seed=4)
    b64 = base64.b64encode(image).decode()
    # Every answer compared below comes from the same cache state: the prompt cached by a first ask, all of it reused
    # but its last token (as llama-server's slot does). A cold prefill and a warm one round differently on some CPUs
    # (a one-token batch is not a slice of a prompt batch), which can tip the random projector's greedy near-ties.
    ask(runner, image, "image/jpeg")
    chat = ask(runner, image, "image/jpeg")
    text, n_prompt = chat["choices"][0]["message"]["content"], chat["usage"]["prompt_tokens"]
    claude = runner.post("/v1/messages", json={**GREEDY, "messages": [{"role": "user", "content": [
        {"type": "text", "text": QUESTION},
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": b64}}]}]}).get_json()
    assert claude["content"][0]["text"] == text
    assert claude["usage"]["input_tokens"] + claude["usage"].get("cache_read_input_tokens", 0) == n_prompt
    responses = runner.post("/v1/responses", json={"temperature": 0, "max_output_tokens": 16, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                     {"type": "input_image", "image_url": data_url(image, "image/jpeg")}]}]}).get_json()
    assert responses["output"][-1]["content"][0]["text"] == text
    assert responses["usage"]["input_tokens"] == n_prompt
    # Ollama puts a message's images before its text (raw base64): the chat prompt with the image first.
    ollama = chat_to_openai({"model": "m", "stream": False, "options": {"temperature": 0, "num_predict": 16},
                             "messages": [{"role": "user", "content": QUESTION, "images": [b64]}]})
    image_first = {**GREEDY, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image, "image/jpeg")}}, {"type": "text", "text": QUESTION}]}]}
    runner.post(CHAT, json=image_first)
    a, b = runner.post(CHAT, json=ollama).get_json(), runner.post(CHAT, json=image_first).get_json()
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
