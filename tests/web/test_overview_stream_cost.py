"""The Overview's CPU per 1,000 tokens card: serve's and the runners' figures over the chosen range."""

from app.gateway.context import services
from app.telemetry.stream_cost import STEP_S, StreamCost, counter_total
from tests.telemetry.test_stream_cost import Clock, FakePs


def test_the_card_shows_serve_and_runner_cpu_per_1k_tokens_over_the_range(app, admin):
    hearth = services(app)
    assert hearth.sampler.stream_cost is not None  # serve wires it in with the sampler
    empty = admin.get("/partials/overview/stream-cost?range=5m").get_data(as_text=True)
    assert 'id="overview-stream-cost"' in empty and "No tokens generated in this range yet" in empty
    ps, clock = FakePs(), Clock()
    tokens = hearth.metrics.completion_tokens
    hearth.sampler.stream_cost = cost = StreamCost(lambda: counter_total(tokens), clock=clock, ps=ps, serve_pid=1)
    ps.cpu[7] = 10.0
    cost.sample([7])
    # An hour ago: 1,000 tokens at a high cost; the last step: 2,000 tokens at serve 0.1 s, runner 0.8 s per 1k.
    clock.now += 3600 - STEP_S
    ps.cpu[1], ps.cpu[7] = 5.0, 20.0
    tokens.labels("chat").inc(1000)
    cost.sample([7])
    clock.now += STEP_S
    ps.cpu[1], ps.cpu[7] = 5.2, 21.6
    tokens.labels("voice").inc(2000)
    cost.sample([7])
    html = admin.get("/partials/overview/stream-cost?range=5m").get_data(as_text=True)
    assert '<tr data-process="serve"><td>hearth serve (gateway, relay)</td><td class="right">0.100</td>' in html
    assert '<tr data-process="runner"><td>runners on this box</td><td class="right">0.800</td>' in html
    assert "Over 2000 tokens" in html
    # The 24 h range reaches the first point: 3,000 tokens, serve 5.2 s and the runner 11.6 s over them.
    day = admin.get("/partials/overview/stream-cost?range=24h").get_data(as_text=True)
    assert '<td class="right">1.733</td>' in day and '<td class="right">3.867</td>' in day
    # The page carries the card in the throughput section.
    page = admin.get("/?range=5m").get_data(as_text=True)
    section = page.split('id="section-throughput"', 1)[1].split("</details>", 1)[0]
    assert 'id="overview-stream-cost"' in section and "0.800" in section
