"""The Bench page with a speculation axis: the arms, their drafting figures, the finding, its Apply and its measure."""

import json
import re
import threading

from sqlalchemy import select

from app.gateway.context import services
from app.store.models import Model, RunnerSettings, utcnow
from app.verdict import sessions as store
from app.verdict.decide import Thresholds, decide
from app.verdict.results import RunResult, as_evidence, summarise
from app.web import bench as bench_page

CODE = "def merge_intervals(intervals: list[list[int]]) -> list[list[int]]:\n    result = []\n"


def _row(end_s, timings, output=CODE):
    return {"idx": 0, "class_name": "coding", "priority": 2, "sent_s": 0.0, "first_token_s": 0.5, "end_s": end_s,
            "prompt_tokens": 600, "completion_tokens": 64, "max_tokens": 64, "status": "ok", "error": None,
            "server_timings": timings, "output": output}


def make_spec_session(app, on_samples=()):
    """A finished code-edit session: hearth off and ngram-lookup (its runs with on_samples), two repetitions, and its
    verdict."""
    h = services(app)
    model = h.catalog.default_model.stem
    runs = []
    with h.sessions() as s:
        now = utcnow()
        if s.scalar(select(Model).where(Model.name == model)) is None:
            s.add(Model(name=model, source="default", first_seen_at=now, last_seen_at=now))
            s.commit()
        policies = store.policies(s)
        sid = store.create_session(s, "code-edit", model, {"model_name": model, "spec": ["off", "ngram-lookup"],
                                                           "scenario_kind": "script"})
        for rep in range(2):
            for target, row in (("continuous+off", _row(3.0, {"predicted_n": 64})),
                                ("continuous+ngram-lookup", _row(1.5, {"draft_n": 60, "draft_n_accepted": 51}))):
                samples = list(on_samples) if target.endswith("ngram-lookup") else []
                run = RunResult(target, "hearth", 1, [row], samples, rep=rep, slots=2)
                run.summary = summarise(run.requests, run.samples, policies)
                store.save_run(s, sid, run)
                runs.append(run)
        verdict = decide(as_evidence(runs), policies, Thresholds(), None, {"speculation": "off"},
                         every_rep=as_evidence(runs))
        store.finish_session(s, sid, json.loads(json.dumps(verdict.as_dict())))
    return sid, model


def test_the_session_shows_each_arm_the_finding_and_applies_it(app, admin, csrf_token):
    sid, model = make_spec_session(app)
    html = admin.get(f"/bench?session={sid}").get_data(as_text=True)
    assert 'id="bench-spec"' in html and 'data-arm="continuous+ngram-lookup"' in html
    row = re.search(r'data-arm="continuous\+ngram-lookup">(.*?)</tr>', html, re.S).group(1)
    assert "85 %" in row and "yes (2 of 2, against continuous+off)" in row
    assert 'data-kind="speculation_on"' in html and "Apply: speculation = auto" in html
    # The finding names the run that would measure the mix: the page starts it on a runner.
    assert '<input type="hidden" name="scenario" value="household">' in html
    assert '<input type="hidden" name="spec" value="off,auto">' in html and "Measure household" in html
    token = csrf_token(admin, "/bench")
    r = admin.post(f"/bench/sessions/{sid}/apply/0", data={"csrf_token": token})
    assert r.status_code == 302
    with services(app).sessions() as s:
        model_id = s.scalar(select(Model.id).where(Model.name == model))
        rs = s.scalar(select(RunnerSettings).where(RunnerSettings.model_id == model_id))
        assert rs.speculation == "auto"
    assert "speculation default → auto" in admin.get("/bench").get_data(as_text=True)


def test_the_session_shows_what_the_cost_rule_decided_per_source_and_why(app, admin):
    # The phase samples read a hearth runner's hearth:spec_source_* series before the first request and after the last.
    before = {"phase": "before", "t_s": 0.0, "spec_rule": {"lookup:16": {"draft": 2, "cut": 1, "explore": 0}}}
    after = {"phase": "after", "t_s": 3.0, "spec_rule": {
        "lookup:16": {"draft": 9, "cut": 5, "explore": 1, "acceptance": 0.97, "length": 64, "kept_tokens": 40.5,
                      "cost_tokens": 27.9},
        "lookup:2": {"draft": 0, "cut": 0, "explore": 0, "acceptance": 0.4, "length": 0, "kept_tokens": 0.4,
                     "cost_tokens": 0.5}}}
    sid, _ = make_spec_session(app, on_samples=(before, after))
    html = admin.get(f"/bench?session={sid}").get_data(as_text=True)
    row = re.search(r'data-arm="continuous\+ngram-lookup">(.*?)</tr>', html, re.S).group(1)
    cell = re.search(r'data-source="lookup:16">(.*?)</div>', row, re.S).group(1)
    assert "drafted 7, cut 4, explored 1" in " ".join(cell.split())  # over the run: after less before
    assert "64 tokens sent" in cell and "acceptance 0.97" in cell and "~40.5 tokens for the time of 27.9" in cell
    assert 'data-source="lookup:2"' not in row  # a source the rule never decided for in the run
    off = re.search(r'data-arm="continuous\+off">(.*?)</tr>', html, re.S).group(1)
    assert "data-source" not in off


def test_a_runs_evidence_shows_its_drafts_and_output(app, admin):
    sid, _ = make_spec_session(app)
    with services(app).sessions() as s:
        run = next(r for r in store.load_runs(s, sid) if r.target == "continuous+ngram-lookup")
    html = admin.get(f"/bench/runs/{run.run_id}").get_data(as_text=True)
    assert "draft_n 60" in html and "draft_n_accepted 51" in html
    assert "output (" in html and "merge_intervals(intervals: list[list[int]])" in html


def test_start_takes_the_scenarios_arms_or_the_forms(app, admin, csrf_token, monkeypatch):
    seen = []
    done = threading.Event()

    def fake_run_bench(cfg, sessions, progress=None, log=None):
        seen.append(cfg)
        done.set()
        raise RuntimeError("not measuring in a page test")

    monkeypatch.setattr(bench_page, "run_bench", fake_run_bench)
    token = csrf_token(admin, "/bench")
    r = admin.post("/bench/start", data={"csrf_token": token, "scenario": "code-edit", "levels": "1",
                                         "mode_continuous": "1"})
    assert r.status_code == 302 and done.wait(10)
    assert seen[-1].spec == ("off", "ngram-lookup") and seen[-1].llama_spec == ()
    assert admin.post("/bench/start", data={"csrf_token": token, "scenario": "household", "mode_continuous": "1",
                                            "spec": "off,eagle"}).status_code == 400
