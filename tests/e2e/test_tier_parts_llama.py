"""On the real Gemma 3 270M behind `hearth runner`: the sampler's four prompt-token parts add up to what the clients
were told, and a filled RAM tier grows the runner's RSS by no more than the budget the estimate counts for it."""

import psutil
import pytest

from app.exposition import parse_exposition
from app.telemetry.sampler import prompt_parts, tier_totals
from tests.helpers import house_system_prompt

pytestmark = pytest.mark.model

SYSTEM = house_system_prompt(3)  # ~1,000 tokens: two of them fill most of 2,048 cells
OTHER = "A story about the sea, told slowly. " + " ".join(f"Wave {i} rolls in and out again." for i in range(120))


def complete(runner, prompt: str) -> dict:
    """One greedy completion; its usage as the client reads it."""
    r = runner.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def rss(process: psutil.Process) -> int:
    """Resident memory of the runner's process tree (the command and the worker serving the model)."""
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


def scrape(runner):
    return parse_exposition(runner.client.get("/metrics").text)


def test_computed_and_reused_prompt_tokens_add_up_to_the_clients_prompt_tokens(start_runner):
    runner = start_runner("--ctx", "2048", "--parallel", "2", "--cache-ram", "256")
    before = prompt_parts(scrape(runner))
    usages = [
        complete(runner, f"{SYSTEM}\nUser: Is the kitchen light on?"),  # computed
        complete(runner, f"{SYSTEM}\nUser: Is the hall fan on?"),  # the system prompt from the KV cache
        complete(runner, OTHER),  # needs the system prompt's cells: its entry goes to the RAM tier
        complete(runner, f"{SYSTEM}\nUser: Is the garage plug on?"),  # the system prompt back from the RAM tier
    ]
    after = prompt_parts(scrape(runner))
    parts = {k: after[k] - before[k] for k in after}
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert sum(parts.values()) == prompt
    assert parts["prompt_computed_tok_s"] == prompt - cached
    assert parts["prompt_kv_tok_s"] + parts["prompt_ram_tok_s"] + parts["prompt_disk_tok_s"] == cached
    n_system = len(runner.client.post("/tokenize", json={"content": SYSTEM}).json()["tokens"])
    second, fourth = (u["prompt_tokens_details"]["cached_tokens"] for u in (usages[1], usages[3]))
    assert second >= n_system - 2 and fourth >= n_system - 2
    # The fourth turn's cells came from the RAM tier, the second's from the KV cache; nothing from the disk (off).
    assert parts["prompt_ram_tok_s"] >= n_system - 16 and parts["prompt_kv_tok_s"] >= second
    assert parts["prompt_disk_tok_s"] == 0
    totals = tier_totals(scrape(runner))
    assert totals["ram_hits"] >= 1 and totals["ram_restored_tokens"] == parts["prompt_ram_tok_s"]


def test_a_filled_ram_tier_grows_the_runners_rss_within_its_budget(start_runner):
    budget_mib, tolerance_mib = 48, 24
    runner = start_runner("--ctx", "2048", "--parallel", "2", "--cache-ram", str(budget_mib))
    process = psutil.Process(runner.proc.pid)
    # Warm: one long prompt computed, so the compute buffers and the KV cache's pages are touched before the baseline.
    complete(runner, f"{SYSTEM}\nUser: warm up")
    baseline = rss(process)
    peak = baseline
    # Different long prompts: each evicts an older one's entry into the tier, which keeps the newest within 48 MiB.
    for i in range(6):
        complete(runner, f"Household {i}. {SYSTEM}\nUser: Which lights are on in house {i}?")
        peak = max(peak, rss(process))
    totals = tier_totals(scrape(runner))
    assert totals["ram_budget_bytes"] == budget_mib * 2**20
    # The tier filled: it dropped entries to stay within the budget and holds most of it.
    assert totals["ram_bytes"] <= budget_mib * 2**20 and totals["ram_bytes"] >= budget_mib * 2**20 // 3
    assert scrape(runner).value("hearth:kv_tier_dropped_total", {"tier": "ram"}) >= 1
    growth_mib = (peak - baseline) / 2**20
    print(f"RAM tier {totals['ram_bytes'] / 2**20:.1f} MiB of {budget_mib}; RSS {baseline / 2**20:.0f} -> "
          f"peak {peak / 2**20:.0f} MiB (+{growth_mib:.1f} MiB)")
    assert growth_mib <= budget_mib + tolerance_mib
