"""POST /hearth/hold on a runner's whole app (fake model): a hold serve's CoreShare sends, its bad bodies refused."""

import pytest


def test_a_hold_is_taken_and_lifted_and_the_answer_counts_the_seconds_paused(make_runner):
    c = make_runner()
    r = c.post("/hearth/hold", json={"priority": 0, "for_s": 30})
    assert r.status_code == 200 and r.json == {"priority": 0, "for_s": 30.0, "held_seconds_total": 0.0}
    r = c.post("/hearth/hold", json={"priority": None})
    assert r.status_code == 200 and r.json["for_s"] == 0


@pytest.mark.parametrize("body, param", [
    ({"priority": 0, "for_s": 500}, "for_s"),  # beyond MAX_HOLD_S: a hold must end by itself
    ({"priority": -1}, "priority"),
    ({"priority": 0, "until": 5}, "until"),  # an unknown field is a mistake, not ignored
])
def test_a_bad_hold_is_a_400_naming_the_field(make_runner, body, param):
    r = make_runner().post("/hearth/hold", json=body)
    assert r.status_code == 400 and param in r.json["error"]["message"]


def test_a_hold_asks_for_the_runners_key():
    from werkzeug.test import Client

    from app.engine.model_config import ModelConfig
    from app.runner.app import create_app
    from app.runner.config import RunnerConfig

    app = create_app(RunnerConfig(ModelConfig(path="/models/fake.gguf"), api_keys=("sk-one",)), load=False)
    assert Client(app).post("/hearth/hold", json={"priority": 0}).status_code == 401
