"""llama.cpp's tools/server/tests/unit/test_kv_keep_only_active.py, against `hearth runner` (real HTTP, real Gemma).

What llama.cpp checks there: with a unified KV cache and --cache-ram, an idle slot's cells leave the KV
cache when another slot needs it, are kept in host RAM, and a later request with the same prompt gets them
back (timings.cache_n > 0, fewer prompt tokens computed) instead of prefilling it; with the feature off
nothing is moved. Its evidence is the server's debug log tags; Hearth's is /metrics.

Hearth keeps idle prefixes in free KV space rather than clearing them at every new task (a NAS's household
rarely overlaps, and the cells cost nothing while free), so the pressure is made explicit: the second prompt
needs the cells the first one's cached prefix holds. The checks are the same: moved out on that need (a tier
save), restored on the repeat (a tier hit, cache_n > 0, prompt_n below the first time's, the same greedy
answer), the follow-up served from the KV cache with nothing moved, and `--cache-ram 0` moving nothing.
"""

import pytest

pytestmark = pytest.mark.model

LONG_PROMPT = (
    "Once upon a time in a land far away, there lived a brave knight "
    "who traveled across mountains and rivers to find the legendary "
    "golden sword hidden deep within the enchanted forest of whispers. "
    "He met many creatures along the way including dragons and fairies "
    "and wizards who helped him on his noble quest to save the kingdom."
)
# Long enough that it and the first prompt's cached cells do not fit 256 cells together.
OTHER_PROMPT = "The quick brown fox jumps over the lazy dog. " * 20
N_CTX = 256


def tier_metric(runner, name: str) -> float:
    """A RAM tier sample from /metrics (labelled tier="ram")."""
    for line in runner.client.get("/metrics").text.splitlines():
        if line.startswith(f'{name}{{tier="ram"}} '):
            return float(line.split()[1])
    raise KeyError(name)


def complete(runner, prompt: str, **extra) -> dict:
    """POST /completion greedily, 4 tokens, as llama.cpp's test; the answer's JSON."""
    res = runner.client.post("/completion", json={"prompt": prompt, "cache_prompt": True, "n_predict": 4,
                                                  "temperature": 0.0, **extra})
    assert res.status_code == 200, res.text
    return res.json()


@pytest.fixture
def start(runner_class, gemma_path, tmp_path):
    """Start a runner with llama.cpp's test settings (2 slots, unified KV) plus the given flags; stop it after."""
    started = []

    def go(*args: str):
        r = runner_class(gemma_path, tmp_path / f"runner{len(started)}.log", "--ctx", str(N_CTX), "--parallel", "2",
                         *args).wait_ready()
        started.append(r)
        return r

    yield go
    for r in started:
        r.stop()


def token_count(runner, text: str) -> int:
    """Tokens of a prompt as the runner counts them (with BOS)."""
    return len(runner.client.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"])


def test_clear_and_restore(start):
    runner = start("--cache-ram", "100")
    assert token_count(runner, LONG_PROMPT) + token_count(runner, OTHER_PROMPT) + 8 > N_CTX
    first = complete(runner, LONG_PROMPT, id_slot=0)
    original_prompt_n = first["timings"]["prompt_n"]
    assert tier_metric(runner, "hearth:kv_tier_saves_total") == 0  # its cells stay while nothing needs them

    complete(runner, OTHER_PROMPT, id_slot=1)  # needs the cells of the first prompt's cached prefix
    assert tier_metric(runner, "hearth:kv_tier_saves_total") == 1
    assert tier_metric(runner, "hearth:kv_tier_bytes") > 0

    again = complete(runner, LONG_PROMPT)  # restored from cache-ram
    assert tier_metric(runner, "hearth:kv_tier_hits_total") == 1
    assert again["timings"]["cache_n"] > 0
    assert again["timings"]["prompt_n"] < original_prompt_n
    assert again["content"] == first["content"]

    saves = tier_metric(runner, "hearth:kv_tier_saves_total")
    follow = complete(runner, LONG_PROMPT + " The knight finally reached the castle gates.")
    assert follow["timings"]["cache_n"] > 0  # the restored prefix is in the KV cache again
    assert tier_metric(runner, "hearth:kv_tier_hits_total") == 1  # no restore needed
    assert tier_metric(runner, "hearth:kv_tier_saves_total") == saves  # nothing moved out


def test_disabled_with_flag(start):
    runner = start("--cache-ram", "0")
    first = complete(runner, LONG_PROMPT, id_slot=0)
    complete(runner, OTHER_PROMPT, id_slot=1)
    assert tier_metric(runner, "hearth:kv_tier_saves_total") == 0
    again = complete(runner, LONG_PROMPT)
    assert again["timings"]["cache_n"] == 0  # evicted and gone: computed again
    assert again["timings"]["prompt_n"] == first["timings"]["prompt_n"]
    assert again["content"] == first["content"]
    assert tier_metric(runner, "hearth:kv_tier_hits_total") == 0
