"""Through `hearth serve` with default settings: a prompt's cached prefix outlives a serve restart (the disk KV tier)."""

import time

import pytest

pytestmark = pytest.mark.model

# ~300 tokens: a prefix worth restoring, and within SMALL_RUNNERS' 512 cells with the answer.
PROMPT = ("You are the voice assistant of a family home. These are the devices of the house:\n"
          + "".join(f"- light {i} in room {i % 7}: {'on' if i % 2 else 'off'}\n" for i in range(24)))


def wait_for(condition, timeout_s: float = 60.0):
    """Poll until condition() is truthy; its value."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)
    return value


def test_a_prefix_cached_before_a_serve_restart_is_restored_from_the_data_volume(start_serve, models_dir):
    s = start_serve(models_dir)
    hdr = {"Authorization": f"Bearer {s.tokens['alice']}"}
    body = {"model": "gemma-3-270m-q4_k_m", "max_tokens": 4, "temperature": 0}
    r = s.client.post("/v1/completions", headers=hdr, json={**body, "prompt": PROMPT + "Question: is light 3 on?"})
    assert r.status_code == 200, r.text
    # Written when the runner goes idle: the kv-cache folder of serve's data volume, one folder per model key.
    wait_for(lambda: list((s.data / "kv-cache").glob("*/*.kv")))
    s.stop()

    s2 = start_serve(models_dir, data=s.data, tokens=[])
    r = s2.client.post("/v1/completions", headers=hdr, json={**body, "prompt": PROMPT + "Question: is light 4 on?"})
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 250  # the device list came back from the disk, not from a prefill
