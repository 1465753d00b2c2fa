"""The application factory: typed services installed on the app, jobs bound to the service they act on."""

from app.factory import create_app, scheduler_of, shutdown_app
from app.gateway.context import Services, services


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
        }
    finally:
        shutdown_app(app)
    assert scheduler_of(app) is None
    shutdown_app(app)  # a second call (at exit) returns at once
