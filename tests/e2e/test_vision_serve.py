"""A vision model through `hearth serve`: a projector beside the model in the models folder is paired by name,
its runner started with --mmproj, /api/show lists `vision`, and images arrive through the gateway's APIs
(Ollama's official client, OpenAI chat, Anthropic messages); a model without one answers what to add."""

from __future__ import annotations

import base64
import shutil

import ollama
import pytest

from app.devtools.mmproj import cached_mmproj
from tests.images import data_url, image_bytes, image_message

VISION = "gemma-vision-Q4_K_M"
QUESTION = "Describe this picture in one sentence."


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
