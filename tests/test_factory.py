"""The application factory: typed services installed on the app, jobs bound to the service they act on."""

import pytest

from app.factory import create_app, scheduler_of, shutdown_app
from app.gateway.context import Services, services
from tests.helpers import dashboard_app


def test_jobs_are_bound_methods_of_their_services_under_explicit_ids(tmp_path, gemma_path):
    app = create_app({"HEARTH_DATA": str(tmp_path / "data"), "HEARTH_MODELS_DIR": str(tmp_path / "models"),
                      "HEARTH_DEFAULT_MODEL": str(gemma_path), "TESTING": True})
    try:
        svc = services(app)
        assert isinstance(svc, Services)
        jobs = {job.id: job.func for job in scheduler_of(app).get_jobs()}
        assert jobs == {
            "expire_models": svc.residency.expire_idle,
            "check_nodes": svc.residency.check_nodes,
            "rescan_catalog": svc.catalog.rescan,
            "sample_telemetry": svc.sampler.sample_all,
            "rollup_samples": svc.rollups.rollup_samples,
            "prune_samples": svc.rollups.prune_samples,
            "prune_requests": svc.rollups.prune_requests,
            "flush_refusals": svc.refusals.flush,
            "size_targets": svc.targets.run,
            "check_weights": svc.warmer.check,
            "preload_models": svc.preload.run,
            "expire_kv_cache": svc.catalog.expire_kv_cache,
            "expire_speech": svc.speech.expire_idle,
        }
    finally:
        shutdown_app(app)
    assert scheduler_of(app) is None
    shutdown_app(app)  # a second call (at exit) returns at once


@pytest.mark.parametrize(("method", "path", "status", "message"), [
    ("GET", "/v1", 404, "Invalid URL (GET /v1)"),
    ("GET", "/v1/nothing", 404, "Invalid URL (GET /v1/nothing)"),
    ("POST", "/v1/chat/completion", 404, "Invalid URL (POST /v1/chat/completion)"),
    ("GET", "/v1/chat/completions", 405, "GET is not allowed on /v1/chat/completions; use POST"),
    ("DELETE", "/v1/models", 405, "use GET"),
])
def test_unknown_api_paths_and_wrong_methods_answer_in_openai_shape(tmp_path, standin_model, method, path, status,
                                                                     message):
    with dashboard_app(tmp_path, standin_model) as app:
        # A browser's Accept header too: the API never answers with an HTML page.
        r = app.test_client().open(path, method=method, headers={"Accept": "text/html,*/*"})
    assert r.status_code == status and r.mimetype == "application/json"
    err = r.get_json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert message in err["message"], err
    assert err["code"] == ("unknown_url" if status == 404 else "method_not_allowed")
    if status == 405:
        assert "POST" in r.headers["Allow"] or "GET" in r.headers["Allow"]


def test_the_dashboard_keeps_its_html_404(tmp_path, standin_model):
    with dashboard_app(tmp_path, standin_model) as app:
        r = app.test_client().get("/no-such-page", headers={"Accept": "text/html"})
    assert r.status_code == 404 and r.mimetype == "text/html"
