"""The sampler's prompt-token parts and KV tier figures, read from the exposition a real engine's RunnerMetrics writes.

The engine runs on the fake model with both tiers on, so every part happens for real: a prompt computed, the
same prompt again (the KV cache), an eviction and the first prompt back (the RAM tier), and a new process
with an empty KV cache and RAM tier whose prompt comes from the disk tier.
"""

import pytest

from app.engine.engine import Engine
from app.engine.kv_tiers import DiskTier
from app.engine.request import Finished, SamplingParams
from app.exposition import parse_exposition
from app.residency.manager import ModelState
from app.runner.metrics import RunnerMetrics
from app.telemetry.sampler import RateTracker, prompt_parts, sample_runners, tier_totals
from tests.engine.fake_model import FakeModel

SRC = "runner:gemma@local"
PARTS = ("prompt_kv_tok_s", "prompt_ram_tok_s", "prompt_disk_tok_s", "prompt_computed_tok_s")
KEY = {"format": 1, "model": "fake.gguf", "size": 1, "mtime_ns": 1, "template_sha256": "t", "n_ctx": 64}


def fake_model() -> FakeModel:
    """64 cells: one 40-token prompt's entry leaves no room for a second, so the first is evicted to the tier."""
    return FakeModel(n_ctx=64, n_batch=64, n_seq_max=2, transfer_seq=4)


def prompt(tag: int, n: int = 40) -> list[int]:
    """n tokens that share no prefix with another tag's."""
    return [tag * 1000 + i for i in range(n)]


def ask(engine: Engine, tokens: list[int]):
    """One greedy request to its end; its finished stats (prompt and cached tokens as the client gets them)."""
    r = engine.submit(tokens, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    fin = next(ev for ev in engine.events(r) if isinstance(ev, Finished))
    assert fin.error is None
    return fin.stats


class Scrapes:
    """An http_get that answers /metrics with the runner's exposition as it is at each call."""

    def __init__(self, metrics: RunnerMetrics):
        self.metrics = metrics

    def __call__(self, url, timeout_s):
        if url.endswith("/metrics"):
            return self.metrics.render().decode()
        if url.endswith("/slots"):
            return "[]"
        raise AssertionError(url)


def status():
    return [{"name": "gemma", "state": ModelState.READY,
             "nodes": [{"label": "local", "url": "http://127.0.0.1:9001", "healthy": True}]}]


@pytest.fixture
def engines():
    started = []
    yield lambda model, **kw: started.append(Engine(model, clock=model.clock, **kw).start()) or started[-1]
    for e in started:
        e.stop()


def test_the_four_parts_add_up_to_the_clients_prompt_tokens_and_name_where_each_came_from(engines, tmp_path):
    disk = DiskTier(tmp_path, KEY, max_bytes=None)
    engine = engines(fake_model(), cache_ram_bytes=None, cache_disk=disk)
    http, rates = Scrapes(RunnerMetrics(engine)), RateTracker()
    assert sample_runners(status(), http, rates, now=100.0) is not None  # the first scrape: no rate yet
    a, b = prompt(1), prompt(2)
    stats = [ask(engine, a), ask(engine, a + [5, 6])]  # computed, then 40 from the KV cache
    stats.append(ask(engine, b))  # evicts a's entry: saved to the RAM tier
    stats.append(ask(engine, a + [7, 8, 9]))  # a's cells back from the RAM tier
    tiers: dict = {}
    readings = {m: v for s, m, v in sample_runners(status(), http, rates, now=102.0, tiers=tiers) if s == SRC}
    # Rates over the 2 s between the scrapes: × 2 gives the tokens.
    got = {m: readings[m] * 2 for m in PARTS}
    assert got["prompt_kv_tok_s"] == pytest.approx(stats[1].num_cached_tokens) == 40
    assert got["prompt_ram_tok_s"] == pytest.approx(stats[3].num_cached_tokens) == 40
    assert got["prompt_disk_tok_s"] == 0
    client_prompt = sum(s.num_prompt_tokens for s in stats)
    client_cached = sum(s.num_cached_tokens for s in stats)
    assert sum(got.values()) == pytest.approx(client_prompt)
    assert got["prompt_computed_tok_s"] == pytest.approx(client_prompt - client_cached)
    # The tier totals beside them, as the runner's own /metrics says.
    t = tiers[SRC]
    assert t["ram_hits"] == 1 and t["ram_restored_tokens"] == 40 and t["disk_hits"] == 0
    assert t["ram_bytes"] == engine.tiers.num_bytes > 0 and t["restore_seconds"] > 0
    assert readings["kv_tier_ram_bytes"] == t["ram_bytes"]
    engine.stop()
    disk.close()

    # A new runner process: the KV cache and RAM tier are empty, the disk holds what the first one cached.
    disk2 = DiskTier(tmp_path, dict(KEY), max_bytes=None)
    engine2 = engines(fake_model(), cache_ram_bytes=None, cache_disk=disk2)
    http2, rates2 = Scrapes(RunnerMetrics(engine2)), RateTracker()
    sample_runners(status(), http2, rates2, now=200.0)
    back = ask(engine2, a + [7, 8, 9, 10])
    readings = {m: v for s, m, v in sample_runners(status(), http2, rates2, now=201.0) if s == SRC}
    assert back.num_cached_tokens >= 40
    assert readings["prompt_disk_tok_s"] == back.num_cached_tokens
    assert readings["prompt_kv_tok_s"] == readings["prompt_ram_tok_s"] == 0
    assert readings["prompt_computed_tok_s"] == back.num_prompt_tokens - back.num_cached_tokens
    assert readings["kv_tier_disk_bytes"] > 0
    disk2.close()


def test_a_request_that_asked_not_to_use_the_cache_is_counted_as_computed(engines):
    engine = engines(fake_model(), cache_ram_bytes=None)
    metrics = RunnerMetrics(engine)
    ask(engine, prompt(1))
    r = engine.submit(prompt(1), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), cache_prompt=False)
    fin = next(ev for ev in engine.events(r) if isinstance(ev, Finished))
    parts = prompt_parts(parse_exposition(metrics.render().decode()))
    assert fin.stats.num_cached_tokens == 0
    assert parts == {"prompt_kv_tok_s": 0, "prompt_ram_tok_s": 0, "prompt_disk_tok_s": 0, "prompt_computed_tok_s": 80}


def test_a_stock_llama_server_has_no_parts_and_no_tiers():
    scrape = parse_exposition("# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 10\n")
    assert prompt_parts(scrape) is None and tier_totals(scrape) is None


def test_an_empty_disk_tier_still_reports_its_budget_and_the_entries_it_dropped(engines, tmp_path):
    first = DiskTier(tmp_path, KEY, max_bytes=None)
    bad = first.dir / ("0" * 32 + ".kv")
    first.close()
    bad.write_bytes(b"not an entry")
    disk = DiskTier(tmp_path, dict(KEY), max_bytes=64 * 2**20)  # drops the bad file at its scan: no entry left
    engine = engines(fake_model(), cache_ram_bytes=2**20, cache_disk=disk)
    scrape = parse_exposition(RunnerMetrics(engine).render().decode())
    assert len(disk) == 0
    assert tier_totals(scrape)["disk_budget_bytes"] == 64 * 2**20
    assert tier_totals(scrape)["ram_budget_bytes"] == 2**20
    assert scrape.value("hearth:kv_tier_unreadable_total", {"tier": "disk"}) == 1
    disk.close()
