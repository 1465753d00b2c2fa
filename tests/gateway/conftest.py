"""The gateway's shared `hearth serve` (real runners on the real Gemma GGUF), with tight classes for queue tests."""

import pytest


@pytest.fixture(scope="session")
def serve(start_shared_serve, models_dir):
    """The shared serve: small runners, a tight 'coding' class for queue tests, tokens."""
    s = start_shared_serve(
        models_dir,
        # coding's queue timeout outlasts the request it waits behind even on a loaded 2-core box.
        # Drafting is off per class (the runner still starts with serve's default, --spec-type ngram-lookup):
        # these tests compare greedy answers across requests and APIs, and a verified draft can flip a near-tie
        # of the random-ish Gemma (batched-logits numerics, see issue 30). test_speculation_real_model
        # switches a class on for itself.
        classes={**{name: {"speculation": False} for name in ("voice", "chat", "background")},
                 "coding": {"max_concurrent": 1, "max_queue": 1, "queue_timeout_s": 600, "speculation": False},
                 "documents": {"max_concurrent": 1, "max_queue": 4, "queue_timeout_s": 0.5, "speculation": False}},
        settings={"runner_ctx": 1024, "runner_parallel": 4, "runner_threads": 2},
        tokens=[("alice", "chat", ["voice", "coding", "documents"]), ("kid", "voice", [])],
    )
    yield s
    s.stop()


@pytest.fixture
def gateway_app(tmp_path, standin_model):
    """create_app on a fresh data folder with the stand-in model (a catalog entry nothing can load): for what
    the gateway decides before any runner is asked (authentication, permissions, admission, refusals)."""
    from tests.helpers import dashboard_app

    with dashboard_app(tmp_path, standin_model) as app:
        yield app


@pytest.fixture
def make_token(gateway_app):
    """make_token(member, default_class="chat", allow=(), **permissions) → a bearer header for a new token."""
    from app.gateway.context import services
    from app.gateway.tokens import create_token

    def make(member: str, default_class: str = "chat", allow=(), **permissions) -> dict:
        with services(gateway_app).sessions() as s:
            token, _ = create_token(s, member, default_class, list(allow), **permissions)
        return {"Authorization": f"Bearer {token}"}

    return make


@pytest.fixture
def set_settings(gateway_app):
    """set_settings(name=value, …): store settings and make the gateway read them now."""
    from app.gateway.context import services
    from app.store.settings import set_setting

    def set_(**values) -> None:
        svc = services(gateway_app)
        with svc.sessions() as s:
            for name, value in values.items():
                set_setting(s, name, value)
            s.commit()
        svc.settings.invalidate()

    return set_
