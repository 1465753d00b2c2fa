"""llama-server's /completion with images ({"prompt_string", "multimodal_data"}) before any model sees them: each
malformed body a 400 that says what to send, and a runner without a projector saying what to add. The answers
themselves are checked on the real model (tests/e2e/test_vision_parity.py)."""

from __future__ import annotations

import base64

import pytest

from tests.images import image_bytes

B64 = base64.b64encode(image_bytes(seed=5)).decode()


def refusal(client, prompt) -> dict:
    r = client.post("/completion", json={"prompt": prompt, "n_predict": 2})
    assert r.status_code == 400, r.get_json()
    return r.get_json()["error"]


@pytest.mark.parametrize(("data", "fragment"), [
    ("not a list", "must be a list of images as base64 strings"),
    ([B64, 7], "must be a list of images as base64 strings"),
    ([""], "must be a list of images as base64 strings"),
])
def test_multimodal_data_must_be_a_list_of_base64_images(make_runner, data, fragment):
    err = refusal(make_runner(), {"prompt_string": "<__media__> what is it?", "multimodal_data": data})
    assert fragment in err["message"] and err["param"] == "prompt"


def test_an_image_url_is_refused_where_llama_server_takes_base64_only(make_runner):
    err = refusal(make_runner(), {"prompt_string": "<__media__>", "multimodal_data": ["https://example.invalid/a.png"]})
    assert "multimodal_data.0" in err["message"] and "not a URL" in err["message"]


@pytest.mark.parametrize("text", ["no marker at all", "<__media__> and <__media__>"])
def test_the_markers_must_pair_with_the_images(make_runner, text):
    err = refusal(make_runner(), {"prompt_string": text, "multimodal_data": [B64]})
    assert f"has {text.count('<__media__>')} <__media__> markers for 1 images" in err["message"]


def test_the_prompt_string_must_be_text(make_runner):
    err = refusal(make_runner(), {"prompt_string": ["<__media__>"], "multimodal_data": [B64]})
    assert "'prompt.prompt_string' must be text" in err["message"]


def test_a_runner_without_a_projector_names_the_image_and_what_to_add(make_runner):
    client = make_runner()
    err = refusal(client, {"prompt_string": "<__media__> what is it?", "multimodal_data": [B64]})
    assert err["param"] == "prompt.multimodal_data.0" and err["code"] == "images_unsupported"
    assert "--mmproj" in err["message"]
    # Without images the same prompt form is plain text, as before.
    r = client.post("/completion", json={"prompt": {"prompt_string": "hello", "multimodal_data": []}, "n_predict": 2})
    assert r.status_code == 200, r.get_json()
