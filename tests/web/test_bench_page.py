"""The Bench page: start (background job, live progress that stops itself), sessions, charts, evidence, Apply."""

import json
import re
import threading
from datetime import timedelta

import pytest
from sqlalchemy import select

from app.gateway.context import services
from app.store.models import BenchApplied, Model, RequestRecord, RunnerSettings, utcnow
from app.verdict import sessions as store
from app.verdict.decide import HouseholdOverlap, Recommendation, Verdict
from app.verdict.results import RunResult, summarise
from app.web import bench as bench_page
from tests.helpers import wait_until

ROWS = [
    {"idx": 0, "class_name": "voice", "priority": 0, "sent_s": 0.0, "first_token_s": 0.1, "end_s": 0.5,
     "prompt_tokens": 12, "completion_tokens": 9, "max_tokens": 9, "status": "ok", "error": None,
     "server_timings": {"queue_ms": 1.0, "ttft_ms": 90.0, "total_ms": 490.0}},
    {"idx": 1, "class_name": "chat", "priority": 1, "sent_s": 0.0, "first_token_s": 0.3, "end_s": 1.0,
     "prompt_tokens": 40, "completion_tokens": 15, "max_tokens": 15, "status": "ok", "error": None,
     "server_timings": None},
]
SAMPLES = [{"t_s": 0.2, "in_flight": 2, "util": 0.9, "kv_util": 0.1, "running": 2, "waiting": 0,
            "preemptions_total": 0}]


def bench_finished(admin):
    """A condition for wait_until: the progress poll once it answers 286 (htmx: stop polling), else None."""
    def poll():
        p = admin.get("/bench/progress")
        return p if p.status_code == 286 else None
    return poll


def make_session(app, verdict=True):
    """A finished session with continuous and serial runs at levels 1 and 2; returns (session id, run ids)."""
    h = services(app)
    model = h.catalog.default_model.stem
    run_ids = []
    with h.sessions() as s:
        policies = store.policies(s)
        sid = store.create_session(s, "household", model, {"model_name": model, "n_ctx": 8192, "parallel": 8,
                                                           "machine": {"cpu": "test cpu", "cores": 2, "gpu": None}})
        for level in (1, 2):
            for mode, scale in (("continuous", 1.0), ("serial", 2.0)):
                rows = [dict(r, end_s=r["end_s"] * scale * level) for r in ROWS]
                run = RunResult(mode, "hearth", level, rows, SAMPLES, summarise(rows, SAMPLES, policies), slots=8)
                run_ids.append(store.save_run(s, sid, run))
        v = Verdict(HouseholdOverlap(2, "default", "default (no traffic in the request log yet)", "no traffic"), 2, (
            Recommendation("continuous", "Use continuous batching (1.50× at overlap 2)", ("gain 1.50×",),
                           {"gain": 1.5}, (run_ids[2], run_ids[3]), {"mode": "continuous"}),
            Recommendation("smaller_slots", "Fewer parallel slots", ("flat",), {"knee": 2}, (run_ids[2],),
                           {"parallel": 2}),
            Recommendation("insufficient", "Advice only", ("no change",), {}, (), None),
            Recommendation("targets", "Targets this hardware keeps at the household's overlap",
                           ("voice: TPOT p95 183 ms (missed today's 100 ms) → 230 ms",), {}, (run_ids[2],),
                           {"classes": {"voice": {"tpot_target_ms": 230}}}),
        ))
        store.finish_session(s, sid, json.loads(json.dumps(v.as_dict())) if verdict else None)
    return sid, run_ids


def test_the_page_needs_the_admin(client):
    assert client.get("/bench").status_code in (302, 401)
    assert client.post("/bench/start").status_code in (302, 400, 401)


def test_empty_page(admin):
    page = admin.get("/bench")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    assert "No bench runs yet" in html and "household" in html and "voice-under-background" in html
    assert 'href="/bench"' in html  # in the navigation


def test_session_page_charts_table_verdict_and_evidence(app, admin):
    sid, run_ids = make_session(app)
    html = admin.get("/bench").get_data(as_text=True)
    assert f"Session {sid}" in html and "test cpu" in html
    assert "Use continuous batching (1.50× at overlap 2)" in html
    assert f'href="/bench/runs/{run_ids[2]}"' in html and "Apply: mode = continuous" in html
    assert "Apply: parallel = 2" in html and html.count("Apply:") == 2  # advice only has no button
    assert f'data-bench-chart="/bench/sessions/{sid}/chart/gen_tok_s.json"' in html
    chart = admin.get(f"/bench/sessions/{sid}/chart/gen_tok_s.json").get_json()
    assert chart["x"] == [1, 2] and set(chart["series"]) == {"continuous", "serial"}
    # Serial took twice as long for the same tokens: half the rate.
    assert chart["series"]["serial"][0] == pytest.approx(chart["series"]["continuous"][0] / 2)
    assert admin.get(f"/bench/sessions/{sid}/chart/bogus.json").status_code == 400
    assert admin.get("/bench/sessions/999/chart/gen_tok_s.json").status_code == 404
    raw = admin.get(f"/bench/runs/{run_ids[0]}").get_data(as_text=True)
    assert "Raw evidence" in raw and "voice" in raw and "0.100" in raw and "queue_ms 1" in raw
    assert admin.get("/bench/runs/999").status_code == 404
    assert admin.get("/bench?session=999").status_code == 404


def test_exports(app, admin):
    sid, run_ids = make_session(app)
    doc = json.loads(admin.get(f"/bench/sessions/{sid}.json").get_data(as_text=True))
    assert [s["run_id"] for s in doc["summaries"]] == run_ids
    assert doc["verdict"]["recommendations"][0]["kind"] == "continuous"
    assert doc["summaries"][0]["summary"]["generated_tokens"] == 24
    csv_text = admin.get(f"/bench/sessions/{sid}.csv").get_data(as_text=True)
    assert csv_text.splitlines()[0].startswith("run_id,target,level,idx") and len(csv_text.splitlines()) == 9
    assert admin.get("/bench/sessions/999.json").status_code == 404


def test_apply_needs_csrf_changes_settings_and_records_who(app, admin, csrf_token):
    sid, _ = make_session(app)
    model = services(app).catalog.default_model.stem
    assert admin.post(f"/bench/sessions/{sid}/apply/1").status_code == 400  # no CSRF token
    with services(app).sessions() as s:
        assert s.scalar(select(RunnerSettings)) is None
    token = csrf_token(admin, "/bench")
    r = admin.post(f"/bench/sessions/{sid}/apply/1", data={"csrf_token": token})
    assert r.status_code == 302
    page = admin.get(r.headers["Location"]).get_data(as_text=True)
    assert f"Applied to {model}: parallel default → 2" in page and "admin applied" in page
    with services(app).sessions() as s:
        m = s.scalar(select(Model).where(Model.name == model))
        rs = s.scalar(select(RunnerSettings).where(RunnerSettings.model_id == m.id))
        assert rs.parallel == 2 and rs.mode is None
        (applied,) = s.scalars(select(BenchApplied)).all()
        assert (applied.applied_by, applied.session_id, applied.changes) == ("admin", sid, {"parallel": [None, 2]})
    bad = admin.post(f"/bench/sessions/{sid}/apply/2", data={"csrf_token": token})
    assert bad.status_code == 400 and "advice only" in bad.get_data(as_text=True)
    assert admin.post(f"/bench/sessions/{sid}/apply/7", data={"csrf_token": token}).status_code == 400


def test_proposed_targets_show_beside_the_evidence_and_apply_to_the_classes(app, admin, csrf_token):
    sid, _ = make_session(app)
    page = admin.get(f"/bench?session={sid}").get_data(as_text=True)
    assert "Apply targets: voice TPOT 230 ms" in page and "missed today&#39;s 100 ms" in page
    r = admin.post(f"/bench/sessions/{sid}/apply/3", data={"csrf_token": csrf_token(admin, "/bench")})
    assert r.status_code == 302
    assert "Applied class targets: voice.tpot_target_ms 100 → 230" in admin.get(r.headers["Location"]).get_data(
        as_text=True)
    assert services(app).classes.get("voice").tpot_target_ms == 230  # the gateway's cache was dropped


def test_start_runs_in_the_background_and_polling_stops_when_done(app, admin, csrf_token, monkeypatch):
    release = threading.Event()
    seen = {}

    def fake_run_bench(cfg, sessions, progress=None, log=None):
        seen["cfg"] = cfg
        log("starting hearth runner (continuous)")
        release.wait(10)
        with sessions() as s:
            sid = store.create_session(s, "household", "gemma", {})
            seen["sid"] = sid
            run = RunResult("continuous", "hearth", 1, ROWS, SAMPLES, summarise(ROWS, SAMPLES, {}))
            store.save_run(s, sid, run)
            store.finish_session(s, sid, None)
        progress(run, 1, 1)

        class Outcome:
            session_id = sid
        return Outcome()

    monkeypatch.setattr(bench_page, "run_bench", fake_run_bench)
    token = csrf_token(admin, "/bench")
    r = admin.post("/bench/start", data={"csrf_token": token, "scenario": "household", "levels": "1,2",
                                         "mode_continuous": "1", "mode_serial": "1"}, headers={"HX-Request": "true"})
    assert r.status_code == 200
    body = r.get_data(as_text=True)
    assert 'hx-get="/bench/progress"' in body and "of 4 runs" in body
    assert seen["cfg"].modes == ("continuous", "serial") and seen["cfg"].levels == (1, 2)
    assert seen["cfg"].model_path == str(services(app).catalog.default_model)
    # A second start while one runs is refused.
    again = admin.post("/bench/start", data={"csrf_token": token, "mode_serial": "1"})
    assert again.status_code == 409
    assert admin.get("/bench/progress").status_code == 200
    release.set()
    p = wait_until(bench_finished(admin), 10, "the bench's progress never said it ended (286)")
    done = p.get_data(as_text=True)
    sid = seen["sid"]
    assert "Done" in done and "hx-trigger" not in done and "see session" in done
    # The last poll brings the finished session and the past runs with it, to swap in out of band.
    current = done[done.index('<div id="bench-current" hx-swap-oob="true">'):]
    assert f'id="bench-session" data-session="{sid}" data-status="done"' in current
    past = done[done.index('<section class="card" id="bench-past" hx-swap-oob="true">'):]
    assert f'data-session="{sid}">' in past and '<td class="past-status">done</td>' in past


def test_a_failed_job_says_so_on_the_page_and_keeps_its_traceback_in_the_log(admin, csrf_token, monkeypatch, caplog):
    def broken_run_bench(cfg, sessions, progress=None, log=None):
        raise RuntimeError("runner for continuous exited with code 1")

    monkeypatch.setattr(bench_page, "run_bench", broken_run_bench)
    token = csrf_token(admin, "/bench")
    with caplog.at_level("ERROR", logger="app.web.bench"):
        assert admin.post("/bench/start", data={"csrf_token": token, "levels": "1", "mode_serial": "1"}).status_code in (200, 302)
        p = wait_until(bench_finished(admin), 10, "the bench's progress never said it ended (286)")
    assert "RuntimeError: runner for continuous exited with code 1" in p.get_data(as_text=True)
    (record,) = [r for r in caplog.records if r.name == "app.web.bench"]
    assert record.levelname == "ERROR" and "household replay failed" in record.getMessage()
    assert record.exc_info and record.exc_info[0] is RuntimeError
    assert "broken_run_bench" in caplog.text  # the traceback names where it failed


def test_start_refuses_bad_input(admin, csrf_token):
    token = csrf_token(admin, "/bench")
    for data, message in (({"levels": "1,x", "mode_serial": "1"}, "levels"),
                          ({"levels": "0", "mode_serial": "1"}, "levels"),
                          ({"scenario": "../etc/passwd", "mode_serial": "1"}, "scenario"),
                          ({"levels": "1"}, "at least one mode")):
        r = admin.post("/bench/start", data={"csrf_token": token, **data})
        assert r.status_code == 400 and message in r.get_data(as_text=True)
    assert admin.get("/bench/progress").status_code == 286  # nothing started


def log_burst(app, singles=20, burst=24):
    """A request log of one-at-a-time chat over the last hours and one background job of `burst` at once."""
    now = utcnow()
    with services(app).sessions() as s:
        for i in range(singles):
            s.add(RequestRecord(arrival_at=now - timedelta(minutes=10 * (i + 1)), total_ms=5000, class_name="chat",
                                model="gemma", status="ok"))
        for i in range(burst):
            s.add(RequestRecord(arrival_at=now - timedelta(hours=5), total_ms=30_000 + 100 * i,
                                class_name="background", model="gemma", status="ok"))
        s.commit()


def test_the_page_shows_the_households_overlap_with_bursts_named_apart(app, admin):
    html = admin.get("/bench").get_data(as_text=True)
    assert "Household overlap" in html and "No requests in the request log yet" in html
    log_burst(app)
    html = admin.get("/bench").get_data(as_text=True)
    # One bar per bucket; the burst's time is at 16–31 at once, the rest at 1.
    for bucket in ("1", "2", "4", "8", "16", "32+"):
        assert f'data-bucket="{bucket}"' in html
    assert ">16–31</span>" in html and ">32+</span>" in html
    assert '<strong id="overlap-typical">1</strong>' in html
    assert "1 burst</strong> of 8 or more at once" in html
    assert "24 requests, up to 24 at once (background 24)" in html


def test_not_enough_evidence_offers_exactly_the_run_that_settles_it(app, admin, csrf_token, monkeypatch):
    from app.store.settings import all_settings
    from app.verdict.decide import decide, thresholds_from
    from app.verdict.overlap import traffic

    log_burst(app)
    h = services(app)
    with h.sessions() as s:
        policies = store.policies(s)
        sid = store.create_session(s, "household", h.catalog.default_model.stem, {"scenario_kind": "mix"})
        for level in (1, 2):
            for mode in ("continuous", "serial"):
                rows = [dict(r, end_s=r["end_s"] * level) for r in ROWS]
                store.save_run(s, sid, RunResult(mode, "hearth", level, rows, SAMPLES,
                                                 summarise(rows, SAMPLES, policies), slots=8))
        t = thresholds_from(all_settings(s))
        v = decide(store.evidence(store.load_runs(s, sid)), policies, t, traffic(s, 7), {"parallel": 8})
        store.finish_session(s, sid, json.loads(json.dumps(v.as_dict())))
    html = admin.get(f"/bench?session={sid}").get_data(as_text=True)
    assert "Not enough evidence: measure at 32" in html and "Apply: mode = serial" not in html
    assert "peak of the largest burst" in html and "Not judged: no measured level reaches it." in html
    form = html[html.index('<form class="bench-measure"'):]
    form = form[:form.index("</form>")]
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form))
    assert fields.pop("csrf_token")
    assert fields == {"scenario": "household", "levels": "1,2,4,8,16,32", "mode_continuous": "1", "mode_serial": "1"}
    seen = {}

    def fake_run_bench(cfg, sessions, progress=None, log=None):
        seen["cfg"] = cfg
        raise RuntimeError("not today")

    monkeypatch.setattr(bench_page, "run_bench", fake_run_bench)
    r = admin.post("/bench/start", data={"csrf_token": csrf_token(admin, "/bench"), **fields},
                   headers={"HX-Request": "true"})
    assert r.status_code == 200
    wait_until(lambda: "cfg" in seen, 10, "the bench job never started")
    assert seen["cfg"].levels == (1, 2, 4, 8, 16, 32) and seen["cfg"].modes == ("continuous", "serial")
    assert seen["cfg"].slots is None


def test_slots_are_swept_from_the_form_and_drawn_apart(app, admin, csrf_token, monkeypatch):
    seen = {}
    monkeypatch.setattr(bench_page, "run_bench", lambda cfg, sessions, progress=None, log=None: seen.setdefault("cfg", cfg))
    token = csrf_token(admin, "/bench")
    bad = admin.post("/bench/start", data={"csrf_token": token, "mode_serial": "1", "slots": "0,4"})
    assert bad.status_code == 400 and "slots" in bad.get_data(as_text=True)
    assert admin.post("/bench/start", data={"csrf_token": token, "mode_continuous": "1", "levels": "8",
                                            "slots": "4, 8"}).status_code == 302
    wait_until(lambda: "cfg" in seen, 10, "the bench job never started")
    assert seen["cfg"].slots == (4, 8)
    h = services(app)
    with h.sessions() as s:
        sid = store.create_session(s, "household", "gemma", {})
        for mode, slots in (("continuous", 4), ("continuous", 8), ("serial", 4)):
            store.save_run(s, sid, RunResult(mode, "hearth", 8, ROWS, SAMPLES, summarise(ROWS, SAMPLES, {}), slots=slots))
        store.finish_session(s, sid, None)
    chart = admin.get(f"/bench/sessions/{sid}/chart/gen_tok_s.json").get_json()
    assert set(chart["series"]) == {"continuous · 4 slots", "continuous · 8 slots", "serial"}
    html = admin.get(f"/bench?session={sid}").get_data(as_text=True)
    assert '<td class="right">8</td><td class="right">4</td>' in html  # L and slots columns
