"""The disk KV tier through real `hearth runner` processes on the real Gemma: a stable system prompt survives a restart."""

import pytest

from tests.helpers import house_system_prompt

pytestmark = pytest.mark.model

# ~1,300 tokens: more than two windows of Gemma 3's sliding window (512).
SYSTEM = house_system_prompt(4)


def tier_metric(runner, name: str, tier: str) -> float:
    """A tier's sample from /metrics."""
    for line in runner.client.get("/metrics").text.splitlines():
        if line.startswith(f'{name}{{tier="{tier}"}} '):
            return float(line.split()[1])
    raise KeyError(name)


def ask(runner, question: str) -> dict:
    """A greedy raw completion after the system prompt; the answer's JSON."""
    res = runner.client.post("/completion", json={"prompt": f"{SYSTEM}\nUser: {question}", "n_predict": 12,
                                                  "temperature": 0.0, "cache_prompt": True, "n_probs": 3})
    assert res.status_code == 200, res.text
    return res.json()


@pytest.fixture
def start(runner_class, gemma_path, tmp_path):
    """Start runners (2,048 cells, 2 slots) with extra flags; every one is stopped after the test."""
    started = []

    def go(*args: str):
        r = runner_class(gemma_path, tmp_path / f"runner{len(started)}.log", "--ctx", "2048", "--parallel", "2",
                         *args).wait_ready()
        started.append(r)
        return r

    yield go
    for r in started:
        if r.proc.poll() is None:
            r.stop()


def test_a_system_prompt_cached_before_a_restart_is_read_from_disk_with_the_same_answer(start, tmp_path):
    disk = tmp_path / "kv"
    first = start("--cache-disk", str(disk))
    ask(first, "Count with me: 1, 2, 3, 4,")
    first.stop()  # SIGTERM: the worker writes what the disk lacks before it exits
    (folder,) = [p for p in disk.iterdir() if p.is_dir()]
    assert [p for p in folder.iterdir() if p.suffix == ".kv"]

    second = start("--cache-disk", str(disk))
    restored = ask(second, "Now the months: January, February, March,")
    assert tier_metric(second, "hearth:kv_tier_hits_total", "disk") == 1
    assert restored["timings"]["cache_n"] > 1000  # the system prompt came from the disk

    # The reference: no tiers; the second question once after the first (a prefix kept in the KV cache) and once
    # alone (a full prefill). The same greedy tokens as both.
    plain = start("--cache-ram", "0")
    ask(plain, "Count with me: 1, 2, 3, 4,")
    kept = ask(plain, "Now the months: January, February, March,")
    alone = start("--cache-ram", "0", "--no-prefix-cache")
    prefilled = ask(alone, "Now the months: January, February, March,")
    assert kept["timings"]["cache_n"] == restored["timings"]["cache_n"]
    assert restored["content"] == kept["content"] == prefilled["content"]
    # The restored cells are the saved bytes: the probabilities are those of the kept prefix, exactly.
    assert restored["completion_probabilities"] == kept["completion_probabilities"]
