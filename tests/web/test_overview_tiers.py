"""The overview's stacked chart of prompt tokens by where they came from, and its KV tier card.

The figures come from a real engine's exposition (the fake model with the RAM tier on), scraped by the sampler
and stored as it stores them, so the chart's parts are the runner's own counters turned into rates.
"""

from app.engine.engine import Engine
from app.engine.request import Finished, SamplingParams
from app.gateway.context import services
from app.residency.manager import ModelState
from app.runner.metrics import RunnerMetrics
from app.telemetry.sampler import RateTracker, sample_runners, store_readings
from tests.engine.fake_model import FakeModel

NOW_S = 1_790_000_000
PROMPT_A = [1000 + i for i in range(40)]
PROMPT_B = [2000 + i for i in range(40)]


def ready(*labels):
    return [{"name": "gemma", "state": ModelState.READY,
             "nodes": [{"label": label, "url": f"http://{label}:9", "healthy": True} for label in labels]}]


def run_household(engine: Engine) -> list:
    """A prompt, the same prompt again, another that evicts it, the first back from the RAM tier: their stats."""
    stats = []
    for tokens in (PROMPT_A, PROMPT_A + [5], PROMPT_B, PROMPT_A + [6, 7]):
        r = engine.submit(tokens, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        fin = next(ev for ev in engine.events(r) if isinstance(ev, Finished))
        assert fin.error is None
        stats.append(fin.stats)
    return stats


def test_the_stacked_chart_sums_the_runners_parts_and_they_add_up_to_the_clients_prompt_tokens(app, admin):
    app.config["HEARTH_CLOCK"] = lambda: float(NOW_S)
    hearth = services(app)
    model = FakeModel(n_ctx=64, n_batch=64, n_seq_max=2, transfer_seq=4)
    engine = Engine(model, clock=model.clock, cache_ram_bytes=None).start()
    try:
        metrics = RunnerMetrics(engine)
        # Two nodes of one model answering with the same runner's figures: the chart sums them.
        http = lambda url, t: metrics.render().decode() if url.endswith("/metrics") else "[]"  # noqa: E731
        rates, tiers = RateTracker(), {}
        first = sample_runners(ready("a", "b"), http, rates, NOW_S - 10)
        stats = run_household(engine)
        second = sample_runners(ready("a", "b"), http, rates, NOW_S - 9, tiers=tiers)
    finally:
        engine.stop()
    with hearth.sessions() as s:
        store_readings(s, NOW_S - 10, first)
        store_readings(s, NOW_S - 9, second)
        s.commit()
    data = admin.get("/api/prompt_parts?range=5m").get_json()
    assert data["stacked"] is True and data["unit"] == "tok/s" and data["step_s"] == 1
    # The same window as every other overview chart: 5 minutes ending now.
    assert (data["start_s"], data["end_s"]) == (NOW_S - 300, NOW_S)
    assert data["order"] == ["KV cache", "RAM tier", "disk tier", "computed"]  # bottom of the stack first
    assert set(data["series"]) == set(data["order"])
    i = data["t"].index(NOW_S - 9)
    got = {label: values[i] for label, values in data["series"].items()}
    prompt = sum(s.num_prompt_tokens for s in stats)
    cached = sum(s.num_cached_tokens for s in stats)
    # One second between scrapes, two nodes: twice the runner's tokens.
    assert got == {"KV cache": 2 * 40, "RAM tier": 2 * 40, "disk tier": 0, "computed": 2 * (prompt - cached)}
    assert sum(got.values()) == 2 * prompt

    # The page draws it beside the other charts, and the tier card gives the runner's own totals.
    hearth.sampler.tiers = tiers
    html = admin.get("/?range=5m").get_data(as_text=True)
    assert 'id="chart-prompt-parts" data-chart-url="/api/prompt_parts"' in html
    card = admin.get("/partials/overview/tiers").get_data(as_text=True)
    ram_row = card.split('data-runner="gemma (a)" data-tier="ram">', 1)[1].split("</tr>", 1)[0]
    t = tiers["runner:gemma@a"]
    assert t["ram_hits"] == 1 and t["ram_restored_tokens"] == 40 and t["ram_budget_bytes"] == -1
    assert "no limit" in ram_row and ">1</td>" in ram_row and ">40</td>" in ram_row
    assert f"mean restore {1000 * t['restore_seconds']:.1f} ms" in card
    disk_row = card.split('data-runner="gemma (a)" data-tier="disk">', 1)[1].split("</tr>", 1)[0]
    assert "(off)" in disk_row


def test_an_empty_range_and_no_tiers_say_so(app, admin):
    app.config["HEARTH_CLOCK"] = lambda: float(NOW_S)
    data = admin.get("/api/prompt_parts?range=1h").get_json()
    assert data["series"] == {} and data["t"] == [] and data["step_s"] == 10
    assert admin.get("/api/prompt_parts?range=2d").status_code == 400
    card = admin.get("/partials/overview/tiers").get_data(as_text=True)
    assert "No hearth runner has reported its KV tiers yet" in card
