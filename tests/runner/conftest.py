"""A runner's whole WSGI app on the fake text model: every route and answer shape, no GGUF."""

from __future__ import annotations

import pytest
from werkzeug.test import Client

from app.engine.model_config import ModelConfig
from app.runner.app import create_app
from app.runner.config import RunnerConfig
from tests.engine.fake_model import FakeTextModel


@pytest.fixture
def make_runner():
    """make_runner(replies=..., template=..., specials=..., **RunnerConfig fields) -> a Client on a loaded runner."""
    apps = []

    def make(replies: dict[str, str] | None = None, template: str | None = None, n_ctx: int = 1024,
             specials: dict[int, bytes] | None = None, **config) -> Client:
        model = FakeTextModel(replies=replies, template=template, n_ctx=n_ctx, n_batch=256, n_seq_max=4,
                              specials=specials)
        cfg = RunnerConfig(ModelConfig(path="/models/fake.gguf", n_ctx=n_ctx, n_seq_max=4), **config)
        app = create_app(cfg, load=False, backend=lambda _: model)
        app.state.load()
        assert app.state.status == "ok", app.state.error
        apps.append(app)
        return Client(app)

    yield make
    for app in apps:
        app.state.engine.stop()

