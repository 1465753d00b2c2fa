"""Through `hearth serve` with default settings: a prompt's cached prefix outlives a serve restart (the disk KV tier)."""

import pytest

from tests.helpers import wait_until

pytestmark = pytest.mark.model

# ~300 tokens: a prefix worth restoring, and within SMALL_RUNNERS' 512 cells with the answer.
PROMPT = ("You are the voice assistant of a family home. These are the devices of the house:\n"
          + "".join(f"- light {i} in room {i % 7}: {'on' if i % 2 else 'off'}\n" for i in range(24)))


def test_a_prefix_cached_before_a_serve_restart_is_restored_from_the_data_volume(start_serve, models_dir):
    s = start_serve(models_dir)
    hdr = {"Authorization": f"Bearer {s.tokens['alice']}"}
    body = {"model": "gemma-3-270m-q4_k_m", "max_tokens": 4, "temperature": 0}
    r = s.client.post("/v1/completions", headers=hdr, json={**body, "prompt": PROMPT + "Question: is light 3 on?"})
    assert r.status_code == 200, r.text
    # Written when the runner goes idle: the kv-cache folder of serve's data volume, one folder per model key.
    wait_until(lambda: list((s.data / "kv-cache").glob("*/*.kv")), 60, "the disk tier wrote nothing")
    s.stop()

    s2 = start_serve(models_dir, data=s.data, tokens=[])
    r = s2.client.post("/v1/completions", headers=hdr, json={**body, "prompt": PROMPT + "Question: is light 4 on?"})
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 250  # the device list came back from the disk, not from a prefill


def test_a_prefix_cached_before_its_model_was_swapped_out_is_restored_when_it_comes_back(start_serve, gemma_path,
                                                                                          models_dir):
    from app.engine.kv_tiers import DEFAULT_CACHE_RAM_MIB
    from app.residency.catalog import scan
    from app.residency.estimate import estimate_memory
    from tests.helpers import SMALL_RUNNERS

    one = estimate_memory(scan(None, gemma_path)[0], 512, 2, ram_tier_mib=DEFAULT_CACHE_RAM_MIB).total_bytes
    s = start_serve(models_dir, settings={**SMALL_RUNNERS, "memory_limit_mb": int(one * 1.5 / 2**20)})
    hdr = {"Authorization": f"Bearer {s.tokens['alice']}"}
    body = {"max_tokens": 4, "temperature": 0}
    r = s.client.post("/v1/completions", headers=hdr,
                      json={**body, "model": "gemma-3-270m-q4_k_m", "prompt": PROMPT + "Question: is light 3 on?"})
    assert r.status_code == 200, r.text
    # The other model evicts it (one fits the budget): its runner exits, writing what the disk lacks.
    r = s.client.post("/v1/completions", headers=hdr, json={**body, "model": "gemma-b", "prompt": "Hi"})
    assert r.status_code == 200, r.text
    assert len(s.runner_arbiters()) == 1
    r = s.client.post("/v1/completions", headers=hdr,
                      json={**body, "model": "gemma-3-270m-q4_k_m", "prompt": PROMPT + "Question: is light 4 on?"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 250
    # One key folder per model file: the copy under another name never read the first one's entries.
    assert len([p for p in (s.data / "kv-cache").iterdir() if p.is_dir()]) == 2
