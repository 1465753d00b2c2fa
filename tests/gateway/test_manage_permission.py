"""The manage permission per token: a family token cannot pull, delete, alias (copy) or load/unload a model;
api_manage_models lets only tokens granted the permission; aliases never shadow a model."""

import shutil

import pytest
from sqlalchemy import select

from app.gateway.context import services
from app.gateway.tokens import set_token
from app.store.models import ApiToken, Model

MODEL = "gemma-3-270m-q4_k_m"  # the stand-in's catalog name

MANAGING = [
    ("post", "/api/pull", {"model": "hf.co/owner/repo:Q4_K_M"}, "pull a model"),
    ("delete", "/api/delete", {"model": MODEL}, "delete a model"),
    ("post", "/api/copy", {"source": MODEL, "destination": "family-model"}, "copy a model (make an alias)"),
    ("post", "/api/generate", {"model": MODEL, "keep_alive": 0}, "load or unload a model"),
    ("post", "/api/chat", {"model": MODEL, "messages": [], "keep_alive": 0}, "load or unload a model"),
    ("post", "/api/generate", {"model": MODEL}, "load or unload a model"),
]
IDS = ["pull", "delete", "alias", "unload-generate", "unload-chat", "load"]


def _call(client, method, path, body, headers):
    return getattr(client, method)(path, json=body, headers=headers)


@pytest.mark.parametrize("method,path,body,action", MANAGING, ids=IDS)
def test_a_family_token_cannot_manage_models(gateway_app, make_token, set_settings, method, path, body, action):
    set_settings(api_manage_models=True)
    r = _call(gateway_app.test_client(), method, path, body, make_token("kid", "voice"))
    assert r.status_code == 403, r.text
    message = r.json["error"]  # Ollama's shape: {"error": "..."}
    assert set(r.json) == {"error"}
    assert f"may not {action}" in message and "lacks the manage permission" in message
    assert "hearth token set" in message and "--manage" in message and "Members page" in message
    # Nothing happened: the model is there, unaliased, not loaded.
    svc = services(gateway_app)
    assert MODEL in svc.catalog.model_specs() and svc.catalog.aliases() == {}
    assert svc.residency.status() == [] or all(m["state"] != "loading" for m in svc.residency.status())


@pytest.mark.parametrize("method,path,body,action", MANAGING[:3], ids=IDS[:3])
def test_with_api_manage_models_off_even_a_manage_token_is_refused(gateway_app, make_token, method, path, body,
                                                                    action):
    r = _call(gateway_app.test_client(), method, path, body, make_token("admin-app", may_manage=True))
    assert r.status_code == 403
    assert "api_manage_models" in r.json["error"] and f"may not {action}" in r.json["error"]


def test_tokenless_lan_clients_never_manage(gateway_app, set_settings):
    set_settings(api_manage_models=True, api_open_on_lan=True)
    client = gateway_app.test_client()
    r = client.post("/api/copy", json={"source": MODEL, "destination": "x"}, environ_base={"REMOTE_ADDR": "192.168.1.9"})
    assert r.status_code == 403 and "requests without a token never have the manage permission" in r.json["error"]


def test_existing_tokens_gain_nothing_and_a_grant_applies_at_once(gateway_app, make_token, set_settings):
    set_settings(api_manage_models=True)
    headers = make_token("alice")
    svc = services(gateway_app)
    with svc.sessions() as s:
        row = s.scalars(select(ApiToken)).one()
        assert row.may_manage is False and row.trust_user_headers is False
        set_token(s, str(row.id), may_manage=True)
    svc.forget_members()
    r = gateway_app.test_client().post("/api/copy", json={"source": MODEL, "destination": "family:latest"},
                                       headers=headers)
    assert r.status_code == 200, r.text
    assert svc.catalog.aliases() == {"family": MODEL}


@pytest.mark.parametrize("destination,problem", [
    (MODEL, "it is the model's own name"),
    (f"{MODEL}:latest", "it is the model's own name"),
    (f"{MODEL}.gguf", "an alias never shadows a model"),
    ("default", "means the household's default model"),
    ("other-model", "it is the name of the model 'other-model'"),
    ("taken", "it is already an alias of 'other-model'"),
])
def test_an_alias_never_shadows_a_model_or_another_alias(gateway_app, make_token, set_settings, destination, problem):
    set_settings(api_manage_models=True)
    svc = services(gateway_app)
    with svc.sessions() as s:
        # A model the store knows (its file may be gone for now) and its alias.
        s.add(Model(name="other-model", path="/models/other-model.gguf", source="folder", alias="taken"))
        s.commit()
    r = gateway_app.test_client().post("/api/copy", json={"source": MODEL, "destination": destination},
                                       headers=make_token("alice", may_manage=True))
    assert r.status_code == 400, r.text
    assert problem in r.json["error"] and f"'{destination}' cannot name '{MODEL}'" in r.json["error"]
    assert svc.catalog.aliases() == {}


def test_a_models_own_name_wins_over_an_alias_set_before_the_rule(gateway_app, standin_model):
    svc = services(gateway_app)
    shutil.copyfile(standin_model, svc.catalog.models_dir / "other-model.gguf")
    svc.catalog.rescan()
    with svc.sessions() as s:
        # As `/api/copy` could before: the other model's alias is this model's name.
        s.scalars(select(Model).where(Model.name == "other-model")).one().alias = MODEL
        s.commit()
    svc.catalog.rescan()
    assert "other-model" in svc.catalog.model_specs() and MODEL not in svc.catalog.aliases()
    assert svc.catalog.resolve(MODEL) == MODEL


def test_a_pulled_file_never_takes_an_alias(gateway_app, make_token, set_settings):
    """/api/pull of a file named like an existing alias: refused with a message naming the alias, and the alias keeps
    its model (before, the pulled model's own name won and took the alias's traffic)."""
    set_settings(api_manage_models=True, pull_allowed_hosts="127.0.0.1")  # a LAN mirror: nothing listens there
    svc = services(gateway_app)
    with svc.sessions() as s:
        s.scalars(select(Model).where(Model.name == MODEL)).one().alias = "family"
        s.commit()
    svc.catalog.rescan()
    assert svc.catalog.pull_name_problem("family").startswith(f"'family' is the alias of the model '{MODEL}'")
    assert "household's default model" in svc.catalog.pull_name_problem("default")
    assert svc.catalog.pull_name_problem("another") is None
    r = gateway_app.test_client().post("/api/pull", json={"model": "http://127.0.0.1:9/family.gguf", "stream": False},
                                       headers=make_token("alice", may_manage=True))
    assert r.status_code == 409, r.text
    assert f"'family' is the alias of the model '{MODEL}'" in r.json["error"]
    assert svc.catalog.resolve("family") == MODEL
