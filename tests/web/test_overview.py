"""Overview page, its tiles partial, and the chart JSON it draws (/api/series, /api/latency)."""

from datetime import UTC, datetime, timedelta

import pytest

from app.gateway.context import services
from app.store.models import RequestRecord
from app.telemetry.rollup import rollup
from app.web import NAV
from app.web.series import percentile
from tests.helpers import store_points

NOW_S = 1_790_000_000  # a fixed "now" for the chart endpoints (HEARTH_CLOCK)
RUNNER = "runner:gemma-3-270m-q4_k_m@local"


@pytest.fixture
def clocked(app):
    """The app with the chart endpoints' clock fixed at NOW_S."""
    app.config["HEARTH_CLOCK"] = lambda: float(NOW_S)
    return app


def put_samples(app, seconds: range, source=RUNNER, metric="gen_tok_s", value=lambda t: float(t % 7)):
    """1-second samples at NOW_S - s for each s in `seconds`."""
    hearth = services(app)
    with hearth.sessions() as s:
        store_points(s, source, metric, [(NOW_S - back, value(NOW_S - back)) for back in seconds])
        s.commit()


def test_overview_empty_state_says_what_to_do(admin):
    page = admin.get("/")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    # No sample yet, no request yet: the page says how to get data, and what policy is in force.
    assert "Waiting for the first telemetry sample" in html
    assert "Send a request to the API" in html
    assert "Create a token on the Members page" in html
    assert "Admission policy in force" in html
    assert "continuous" in html and "Parallel slots" in html and "Batch budget" in html
    assert "Room in the KV cache" in html
    for name in ("voice", "chat", "documents", "coding", "background"):
        assert f'<td class="nowrap">{name}' in html
    # No GPU on this box: CPU and RAM charts, said plainly.
    assert "CPU busy (no GPU)" in html and 'metric=ram_used_bytes' in html
    # The first screen answers first; every chart and the rules sit in sections a person opens, closed at first.
    assert html.index('id="overview-health"') < html.index('<details')
    assert "Working: no model is loaded yet" in html
    for section in ("throughput", "latency", "memory", "speculation", "how"):
        assert f'<details class="section" id="section-{section}">' in html
    assert html.index('id="section-how"') < html.index('id="policy"')


def test_overview_range_picker_and_nav(app, admin):
    html = admin.get("/?range=24h").get_data(as_text=True)
    assert 'data-range="24h" class="active"' in html
    assert 'href="/" class="active" aria-current="page"' in html
    # A nav link shows exactly when a view serves its path.
    served = {rule.rule for rule in app.url_map.iter_rules()}
    for _, path in NAV:
        assert (f'<a href="{path}"' in html) == (path in served), path


def test_tiles_show_the_sampler_latest_readings(app, admin):
    sampler = services(app).sampler
    sampler.latest = {
        "host": {"cpu_pct": 37.0, "ram_used_bytes": 3 * 1024**3, "ram_total_bytes": 8 * 1024**3},
        RUNNER: {"gen_tok_s": 123.4, "prompt_tok_s": 56.0, "running": 3, "waiting": 2, "kv_used_pct": 91.5,
                 "preemptions_s": 0.5},
    }
    sampler.latest_at = datetime.now(UTC).timestamp()
    response = admin.get("/partials/overview/tiles")
    assert response.status_code == 200
    html = response.get_data(as_text=True)
    assert 'hx-trigger="every 2s' in html
    assert "123 tok/s" in html and "3.0 GiB" in html and "8.0 GiB" in html
    assert "KV 92 %" in html and 'model-kv over' in html  # KV above 90 %
    assert "Waiting for the first telemetry sample" not in html


def test_policy_partial_polls_and_names_the_policy(app, admin):
    response = admin.get("/partials/overview/policy")
    assert response.status_code == 200
    html = response.get_data(as_text=True)
    assert 'hx-trigger="every 5s' in html
    name = next(iter(services(app).catalog.model_specs()))
    assert name in html and "unloaded" in html and "512 tokens / iteration" in html
    assert "Who goes first in a step" in html and "90 % of its class&#39;s TPOT target" in html
    assert "lends its spare time" in html and "not measured yet" in html


def test_policy_panel_shows_the_live_prefill_budget(app, admin):
    name = next(iter(services(app).catalog.model_specs()))
    services(app).sampler.latest = {f"runner:{name}@local": {"prefill_budget": 136.0, "budget_tpot_ms": 100.0}}
    html = admin.get("/partials/overview/policy").get_data(as_text=True)
    assert "136 tokens now, for a 100 ms TPOT target" in html


def test_policy_panel_marks_a_target_the_hardware_cannot_keep_and_prices_the_others(app, admin):
    name = next(iter(services(app).catalog.model_specs()))
    slots = services(app).catalog.model_specs()[name].runner.parallel
    # A full batch decodes in 60 ms; beside a 64-token chunk at 1.5 ms a token it keeps (60 + 96) / 0.9 = 173 ms.
    services(app).sampler.latest = {f"runner:{name}@local": {
        "prefill_budget": 64.0, "budget_tpot_ms": 100.0, "full_batch_tpot_ms": 173.3, "full_batch_decode_ms": 60.0,
        "prefill_token_ms": 1.5, "prefill_knee": 64.0, "reachable_tpot_ms": 120.0}}
    html = admin.get("/partials/overview/policy").get_data(as_text=True)
    assert f"173 ms a token with {slots} decoding beside a 64-token prompt chunk" in html and "keeping 120 ms" in html
    # voice (100 ms) and chat (150 ms) are out of reach; documents (200 ms) leaves prompts 180 − 60 ms an iteration.
    rows = {c: html.split(f'"nowrap">{c}', 1)[1].split("</tr>", 1)[0] for c in ("voice", "chat", "documents", "background")}
    assert "out of reach" in rows["voice"] and "out of reach" in rows["chat"]
    assert "out of reach" not in rows["documents"] and "out of reach" not in rows["background"]
    assert (f"voice: 100 ms a token is out of reach at a full batch — {slots} sequences decoding beside a 64-token "
            "prompt chunk take 173 ms a token") in html
    assert (f"documents: keeping 200 ms a token with {slots} sequences decoding leaves prompts 120 ms of each 180 ms "
            "iteration (about 80 tokens): prefill runs at 67 % of its speed while documents decodes.") in html


def test_series_raw_range_shapes(clocked, admin):
    put_samples(clocked, range(400))
    put_samples(clocked, range(0, 400, 2), source="host", metric="cpu_pct", value=lambda t: 50.0)
    data = admin.get("/api/series?metric=gen_tok_s&range=5m").get_json()
    assert data["resolution"] == "samples" and data["step_s"] == 1 and data["unit"] == "tok/s"
    assert list(data["series"]) == ["gemma-3-270m-q4_k_m"]
    assert data["t"] == list(range(NOW_S - 300, NOW_S + 1))
    assert data["series"]["gemma-3-270m-q4_k_m"][-1] == float(NOW_S % 7)
    put_samples(clocked, range(0, 400, 2), metric="running", value=lambda t: 2.0)
    one_source = admin.get("/api/series?metric=gen_tok_s,running&range=5m").get_json()
    # Legends name lines in words (what they count, the model or device), never by metric name.
    assert set(one_source["series"]) == {"written", "being written"}
    both = admin.get("/api/series?metric=gen_tok_s,cpu_pct&range=5m").get_json()
    assert set(both["series"]) == {"gemma-3-270m-q4_k_m · written", "host · CPU"}
    assert both["unit"] == ""
    cpu = both["series"]["host · CPU"]
    # Seconds without a host sample are gaps (null), not zeros.
    assert len(cpu) == len(both["t"]) and None in cpu and 50.0 in cpu


def test_series_one_hour_is_averaged_into_ten_second_points(clocked, admin):
    put_samples(clocked, range(3700), value=lambda t: 1.0 if t % 2 else 3.0)
    data = admin.get("/api/series?metric=gen_tok_s&range=1h").get_json()
    assert data["resolution"] == "samples" and data["step_s"] == 10
    assert all(t % 10 == 0 for t in data["t"])
    assert 360 <= len(data["t"]) <= 362
    assert data["series"]["gemma-3-270m-q4_k_m"][5] == 2.0


@pytest.mark.parametrize(("range_name", "resolution", "step_s"), [
    ("24h", "rollups_1m", 60),
    ("7d", "rollups_1h", 3600),
])
def test_long_ranges_read_rollups(clocked, admin, range_name, resolution, step_s):
    put_samples(clocked, range(0, 3 * 3600, 5), value=lambda t: 4.0)
    hearth = services(clocked)
    with hearth.sessions() as s:
        rollup(s, datetime.fromtimestamp(NOW_S + 3600, UTC))
        s.commit()
    data = admin.get(f"/api/series?metric=gen_tok_s&range={range_name}").get_json()
    assert data["resolution"] == resolution and data["step_s"] == step_s
    assert data["t"] and all(t % step_s == 0 for t in data["t"])
    assert set(data["series"]["gemma-3-270m-q4_k_m"]) == {4.0}


def test_series_refuses_bad_arguments(admin):
    assert admin.get("/api/series").status_code == 400
    unknown = admin.get("/api/series?metric=gen_tok_s,bogus")
    assert unknown.status_code == 400 and "bogus" in unknown.get_json()["error"]["message"]
    bad_range = admin.get("/api/series?metric=cpu_pct&range=3w")
    assert bad_range.status_code == 400 and "5m, 1h, 24h, 7d" in bad_range.get_json()["error"]["message"]
    assert admin.get("/api/latency?metric=speed").status_code == 400


def test_latency_percentiles_per_class(clocked, admin):
    hearth = services(clocked)
    now = datetime.fromtimestamp(NOW_S, UTC)
    with hearth.sessions() as s:
        for i in range(20):
            s.add(RequestRecord(arrival_at=now - timedelta(seconds=25, milliseconds=i), class_name="voice",
                                status="ok", ttft_ms=float(10 * (i + 1)), tpot_ms=5.0))
        s.add(RequestRecord(arrival_at=now - timedelta(seconds=25), class_name="chat", status="ok", ttft_ms=700.0))
        # Refused and old requests do not count.
        s.add(RequestRecord(arrival_at=now - timedelta(seconds=25), class_name="chat", status="rejected", ttft_ms=1.0))
        s.add(RequestRecord(arrival_at=now - timedelta(hours=2), class_name="voice", status="ok", ttft_ms=9999.0))
        s.commit()
    data = admin.get("/api/latency?metric=ttft&range=5m").get_json()
    assert data["unit"] == "ms" and data["step_s"] == 10 and data["sparse"] is True
    assert set(data["series"]) == {"chat p50", "chat p95", "voice p50", "voice p95"}
    assert len(data["t"]) == 1 and data["t"][0] == (NOW_S - 25) // 10 * 10
    assert data["series"]["voice p50"] == [100.0] and data["series"]["voice p95"] == [190.0]
    assert data["series"]["chat p50"] == [700.0]
    hour = admin.get("/api/latency?metric=ttft&range=1h").get_json()
    assert hour["series"]["voice p95"] == [190.0]
    day = admin.get("/api/latency?metric=ttft&range=24h").get_json()
    assert day["step_s"] == 900 and len(day["t"]) == 2  # the 2-hour-old request has its own bucket
    assert 9999.0 in day["series"]["voice p95"]


def test_percentile_nearest_rank():
    values = sorted(range(1, 101))
    assert percentile(values, 50) == 50 and percentile(values, 95) == 95 and percentile(values, 100) == 100
    assert percentile([7.0], 95) == 7.0


def test_a_gpu_box_charts_gpu_utilisation_and_vram(app, admin):
    put_samples(app, range(3), source="gpu:0", metric="gpu_util_pct", value=lambda t: 80.0)
    sampler = services(app).sampler
    sampler.latest = {"gpu:0": {"gpu_util_pct": 80.0, "vram_used_bytes": 5 * 1024**3,
                                "vram_total_bytes": 24 * 1024**3, "gpu_temp_c": 61.0}}
    sampler.latest_at = datetime.now(UTC).timestamp()
    html = admin.get("/").get_data(as_text=True)
    assert "GPU busy" in html and "metric=vram_used_bytes" in html and "CPU busy (no GPU)" not in html
    assert "80 % busy · 61 °C" in html and "5.0 GiB <span class=\"muted\">of 24.0 GiB" in html


def test_the_first_screen_says_which_class_is_slow_and_who_uses_the_box(clocked, admin):
    hearth = services(clocked)
    now = datetime.fromtimestamp(NOW_S, UTC)
    voice_ttft = hearth.classes.get("voice").ttft_target_ms
    with hearth.sessions() as s:
        # Voice's first tokens came late (p95 twice its target) for alice; chat kept its targets for bob.
        for i in range(20):
            s.add(RequestRecord(arrival_at=now - timedelta(seconds=30 + i), class_name="voice", member_name="alice",
                                status="ok", ttft_ms=2 * voice_ttft, tpot_ms=20.0, completion_tokens=10))
        s.add(RequestRecord(arrival_at=now - timedelta(seconds=40), class_name="chat", member_name="bob",
                            status="ok", ttft_ms=100.0, tpot_ms=20.0, completion_tokens=7))
        # Older than the first screen's 5 minutes: not counted.
        s.add(RequestRecord(arrival_at=now - timedelta(minutes=20), class_name="chat", member_name="carol",
                            status="error", error="boom"))
        s.commit()
    html = admin.get("/partials/overview/tiles").get_data(as_text=True)
    health = html.split('id="overview-health"', 1)[1].split("</div>", 1)[0]
    assert f"voice is slow: first token in {2 * voice_ttft / 1000:.1f} s (p95) against {voice_ttft:.0f} ms" in health
    voice = html.split('data-class="voice"', 1)[1].split("</tr>", 1)[0]
    assert "slow" in voice and f"{2 * voice_ttft / 1000:.1f} s" in voice
    assert 'data-member="alice"' in html and "20 requests, 200 tokens in 5 min" in html
    assert 'data-member="bob"' in html and "carol" not in html


def test_a_failed_request_is_said_in_the_health_line(clocked, admin):
    hearth = services(clocked)
    with hearth.sessions() as s:
        s.add(RequestRecord(arrival_at=datetime.fromtimestamp(NOW_S - 10, UTC), class_name="chat", status="error",
                            error="runner stopped"))
        s.commit()
    html = admin.get("/partials/overview/tiles").get_data(as_text=True)
    assert "1 request failed over the last 5 minutes (chat)" in html and "1 failed" in html


def test_no_class_is_out_of_reach_while_the_pace_is_measuring(app, admin):
    name = next(iter(services(app).catalog.model_specs()))
    figures = {"full_batch_tpot_ms": 173.3, "full_batch_decode_ms": 60.0, "prefill_token_ms": 1.5, "prefill_knee": 64.0}
    sampler = services(app).sampler
    sampler.latest = {f"runner:{name}@local": figures, "host": {}}
    sampler.latest_at = datetime.now(UTC).timestamp()
    measured = admin.get("/partials/overview/tiles").get_data(as_text=True)
    badge = '"reach reach-out">out of reach'
    assert badge in measured.split('data-class="voice"', 1)[1].split("</tr>", 1)[0]
    # A runner still warming up exports its full batch's paces as 0 (app/runner/metrics.py): no verdict yet.
    sampler.latest = {f"runner:{name}@local": {**figures, "full_batch_tpot_ms": 0.0, "full_batch_decode_ms": 0.0}}
    warming = admin.get("/partials/overview/tiles").get_data(as_text=True)
    assert badge not in warming
    assert '"badge badge-warn">out of reach' not in admin.get("/partials/overview/policy").get_data(as_text=True)
