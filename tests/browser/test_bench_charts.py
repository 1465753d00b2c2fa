"""The Bench page in a real browser against a real `hearth serve`: its charts finish what they draw, a
single level gets a proper axis, the household's overlap is drawn with its bursts, "measure at N"
starts exactly that run, and a run started from the page ends with its session shown without a reload.

Sessions are written into the serve's store the way run_bench writes them (the raw rows are the
evidence the page recomputes from); the last test runs a real one-level bench through the page.
"""

from datetime import timedelta

import pytest

from app.store.db import open_store, writing_sessions
from app.store.models import RequestRecord, utcnow
from app.verdict import sessions as store
from app.verdict.decide import HouseholdOverlap, Recommendation, Verdict
from app.verdict.results import RunResult, summarise
from tests.browser.conftest import shot

ROW = {"idx": 0, "class_name": "chat", "priority": 1, "sent_s": 0.0, "first_token_s": 0.2, "end_s": 1.0,
       "prompt_tokens": 40, "completion_tokens": 20, "max_tokens": 20, "status": "ok", "error": None,
       "server_timings": None}
SAMPLES = [{"t_s": 0.2, "in_flight": 1, "util": 0.9, "kv_util": 0.2, "running": 1, "waiting": 0,
            "preemptions_total": 0}]
# The uPlot chart of one metric on the page (static/bench.js keeps them in Hearth.benchCharts).
CHART = "metric => (Hearth.benchCharts || []).find(c => c.el.isConnected && c.el.dataset.benchChart.includes(metric))"


@pytest.fixture(scope="module")
def bench_store(served):
    """The serve's own store (SQLite in WAL mode: this process writes, the serve reads)."""
    engine, _ = open_store(served.data)
    yield writing_sessions(engine)
    engine.dispose()


def make_session(sessions, levels, verdict=None):
    """A finished session with continuous and serial runs at these levels; returns its id."""
    with sessions() as s:
        sid = store.create_session(s, "household", "gemma", {"model_name": "gemma", "scenario_kind": "mix"})
        for level in levels:
            for mode, scale in (("continuous", 1.0), ("serial", 2.0)):
                rows = [dict(ROW, idx=i, end_s=ROW["end_s"] * scale * (1 + i)) for i in range(level)]
                store.save_run(s, sid, RunResult(mode, "hearth", level, rows, SAMPLES,
                                                 summarise(rows, SAMPLES, {}), slots=8))
        store.finish_session(s, sid, verdict.as_dict() if verdict else None)
    return sid


def wait_drawn(page, metrics=("gen_tok_s", "ttft_p95_ms", "kv_peak_util", "kv_mean_util")):
    for metric in metrics:
        page.wait_for_function(f"() => {{ const c = ({CHART})('{metric}'); return c && c.plot !== null; }}",
                               timeout=30_000)


def test_charts_lose_their_loading_label_once_drawn(page, bench_store):
    sid = make_session(bench_store, (1, 2, 4))
    page.goto(f"/bench?session={sid}")
    wait_drawn(page)
    labels = page.locator("[data-bench-chart] .chart-empty")
    assert [labels.nth(i).is_visible() for i in range(labels.count())] == [], "a drawn chart still shows a label"
    assert page.evaluate(f"({CHART})('gen_tok_s').points") == 6
    shot(page, "bench-charts")


def test_a_single_level_draws_a_proper_x_axis(page, bench_store):
    sid = make_session(bench_store, (1,))
    page.goto(f"/bench?session={sid}")
    wait_drawn(page)
    for metric in ("gen_tok_s", "ttft_p95_ms"):
        # The tick labels uPlot drew on the canvas for the x axis.
        ticks = page.evaluate(f"({CHART})('{metric}').plot.axes[0]._values")
        assert ticks == ["1"], ticks
        # The one point is inside the plot, not at its edge.
        x = page.evaluate(f"(() => {{ const p = ({CHART})('{metric}').plot; return p.valToPos(1, 'x') / p.bbox.width"
                          f" * devicePixelRatio; }})()")
        assert 0.2 < x < 0.8
    shot(page, "bench-single-level")


def test_overlap_is_drawn_and_measure_at_n_starts_exactly_that_run(page, bench_store):
    now = utcnow()
    with bench_store() as s:
        # Six days ago: a background job of 24 at once, and chat one at a time around it.
        for i in range(24):
            s.add(RequestRecord(arrival_at=now - timedelta(days=6), total_ms=30_000 + 200 * i,
                                class_name="background", model="gemma", status="ok"))
        for i in range(10):
            s.add(RequestRecord(arrival_at=now - timedelta(days=6, hours=1, minutes=5 * i), total_ms=4000,
                                class_name="chat", model="gemma", status="ok"))
        s.commit()
    ov = HouseholdOverlap(24, "burst_peak", "request log, last 7 days", "burst of 24")
    rec = Recommendation("not_enough_evidence", "Not enough evidence: measure at 32", ("r",), {},
                         measure={"levels": [1, 2, 4, 8, 16, 32], "modes": ["continuous", "serial"]})
    sid = make_session(bench_store, (1, 2), Verdict(ov, None, (rec,)))
    page.goto(f"/bench?session={sid}")
    bar = page.locator('.overlap-bar[data-bucket="16"] .overlap-fill')
    assert bar.bounding_box()["height"] > 0
    assert "up to 24 at once (background 24)" in page.locator("#bench-overlap").inner_text()
    shot(page, "bench-overlap")
    posted = []

    def answer(route):
        posted.append(route.request.post_data)
        route.fulfill(status=200, content_type="text/html",
                      body='<div id="bench-progress" class="bench-progress"><p role="status">started</p></div>')

    page.route("**/bench/start", answer)
    page.locator("form.bench-measure button", has_text="Measure at 32").click()
    page.wait_for_selector("#bench-progress:has-text('started')")
    page.unroute("**/bench/start")
    fields = dict(pair.split("=", 1) for pair in posted[0].split("&"))
    assert fields["levels"] == "1%2C2%2C4%2C8%2C16%2C32" and fields["scenario"] == "household"
    assert {k for k in fields if k.startswith("mode_")} == {"mode_continuous", "mode_serial"}


def test_a_finished_run_shows_its_session_without_a_reload(page, bench_store):
    page.set_default_timeout(180_000)  # a real runner on the shared 2-core box
    old = make_session(bench_store, (1, 2))
    page.goto(f"/bench?session={old}")
    wait_drawn(page)
    page.evaluate("window.__sameDocument = true")
    page.fill("input[name=levels]", "1")
    for mode in ("serial", "static"):
        page.uncheck(f"input[name=mode_{mode}]")
    page.click("form.bench-start button[type=submit]")
    page.wait_for_selector("#bench-progress .flash-ok, #bench-progress .flash-bad", timeout=240_000)
    done = page.locator("#bench-progress").inner_text()
    assert page.locator("#bench-progress .flash-bad").count() == 0, done
    assert "Done: 1 run of household" in done
    new = int(done.split("Session ")[1].split(" ")[0])
    assert new > old
    section = page.locator("#bench-session")
    assert section.get_attribute("data-session") == str(new) and section.get_attribute("data-status") == "done"
    assert page.locator(f'#bench-past tr[data-session="{new}"] .past-status').inner_text() == "done"
    assert page.evaluate("window.__sameDocument") is True
    # The swapped-in session's charts are drawn too (one level: continuous at 1).
    wait_drawn(page, ("gen_tok_s",))
    assert page.evaluate(f"({CHART})('gen_tok_s').el.closest('#bench-session').dataset.session") == str(new)
    assert page.locator("#bench-verdict article.recommendation").count() >= 1
    shot(page, "bench-finished")
