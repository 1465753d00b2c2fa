"""A real runner app on a GGUF for module fixtures: created, waited for until loaded, stopped and freed after."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from werkzeug.test import Client

from app.runner.app import create_app
from app.runner.config import RunnerConfig
from tests.helpers import wait_until

LOAD_TIMEOUT_S = 120


@contextlib.contextmanager
def loaded_runner(cfg: RunnerConfig) -> Iterator[Client]:
    """A Client on a runner loaded from cfg (its load must succeed); the engine and model are freed on exit."""
    app = create_app(cfg)
    wait_until(lambda: app.state.status != "loading", LOAD_TIMEOUT_S, "the runner never finished loading")
    assert app.state.status == "ok", app.state.error
    try:
        yield Client(app)
    finally:
        app.state.engine.stop()
        app.state.model.close()
        if app.state.draft is not None:
            app.state.draft.model.close()
