"""API security: tokens by default (the LAN may be opened explicitly), tokens stored only hashed, model
paths confined to the models folder, and no secret in logs, responses or the store."""

from __future__ import annotations

import hashlib
import secrets
import shutil
import sqlite3
from pathlib import Path

import httpx
import pytest

from app.devtools.serve_process import runner_headers_of
from app.gateway.auth import TokenCache, hash_token
from app.gateway.pipeline import from_lan
from app.residency.catalog import OUTSIDE_REASON, scan
from app.residency.supervisor import RUNNER_KEY_ENV
from app.store.settings import REGISTRY
from tests.helpers import SMALL_RUNNERS, metric, query, store_now, wait_until

HELLO = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2}


def written_through(serve) -> None:
    """Return once the store writer has written everything submitted before this call.

    The writer is one queue: a request answered now is recorded after every earlier write, so once
    its row is in the store, so is whatever came before it.
    """
    since = store_now()
    r = serve.client.post("/v1/chat/completions", json=HELLO, headers={"Authorization": f"Bearer {serve.tokens['kid']}"})
    assert r.status_code == 200, r.text
    wait_until(lambda: query(serve.data / "hearth.db", "select id from requests where member_name='kid' and arrival_at >= ?",
                             since), 10, "the marker request was never recorded")


def test_the_api_is_closed_without_a_token_by_default(serve):
    assert REGISTRY["api_open_on_lan"].default is False
    r = serve.client.post("/v1/chat/completions", json=HELLO)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_token"
    assert serve.client.get("/v1/models").status_code == 401


@pytest.mark.parametrize("addr,lan", [
    ("127.0.0.1", True), ("192.168.1.20", True), ("10.1.2.3", True), ("172.16.0.9", True), ("::1", True),
    ("fd12:3456::1", True), ("8.8.8.8", False), ("2001:4860:4860::8888", False), ("", False), ("nonsense", False),
])
def test_only_private_addresses_count_as_lan(addr, lan):
    assert from_lan(addr) is lan


def test_an_api_opened_to_the_lan_serves_tokenless_requests_as_one_member(start_serve):
    s = start_serve(settings={**SMALL_RUNNERS, "api_open_on_lan": True, "api_open_class": "voice"},
                    tokens=[("alice", "chat", [])])
    r = s.client.post("/v1/chat/completions", json=HELLO)
    assert r.status_code == 200, r.text
    assert r.headers["X-Hearth-Class"] == "voice"
    # Opening the LAN does not make a bad token acceptable, nor widen the classes.
    r = s.client.post("/v1/chat/completions", json=HELLO, headers={"Authorization": "Bearer hth_wrong"})
    assert r.status_code == 401
    r = s.client.post("/v1/chat/completions", json=HELLO, headers={"X-Hearth-Class": "chat"})
    assert r.status_code == 403
    r = s.client.post("/v1/chat/completions", json=HELLO, headers={"Authorization": f"Bearer {s.tokens['alice']}"})
    assert r.status_code == 200 and r.headers["X-Hearth-Class"] == "chat"

    def answered():
        rows = query(s.data / "hearth.db", "select member_name, token_id, class_name from requests where status='ok' "
                                           "order by id")
        return rows if len(rows) >= 2 else None

    members = wait_until(answered, 10, "the two answered requests were never recorded")
    assert members == [("lan", None, "voice"), ("alice", members[1][1], "chat")] and members[1][1] is not None


def test_tokens_are_stored_only_as_sha256_and_looked_up_by_hash(serve):
    token = serve.tokens["alice"]
    db = (serve.data / "hearth.db").read_bytes() + (serve.data / "hearth.db-wal").read_bytes() \
        if (serve.data / "hearth.db-wal").exists() else (serve.data / "hearth.db").read_bytes()
    assert token.encode() not in db
    with sqlite3.connect(serve.data / "hearth.db") as c:
        hashes = {h for (h,) in c.execute("select token_hash from api_tokens")}
    assert hashlib.sha256(token.encode()).hexdigest() in hashes
    # The store is only ever asked for a hash: comparing hashes leaks nothing usable about a token
    # (finding a token with a chosen hash prefix is a preimage attack), so no timing attack applies.
    asked = []
    cache = TokenCache(lambda h: asked.append(h))
    cache.lookup(token)
    assert asked == [hash_token(token)]


def test_model_files_must_lie_inside_the_models_folder(tmp_path, standin_model):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copyfile(standin_model, outside / "secret-model.gguf")
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "escape.gguf").symlink_to(outside / "secret-model.gguf")
    (folder / "dotdot.gguf").symlink_to(Path("..") / "elsewhere" / "secret-model.gguf")
    shutil.copyfile(standin_model, folder / "real.gguf")
    (folder / "inside-link.gguf").symlink_to(folder / "real.gguf")
    entries = {e.name: e for e in scan(folder, None)}
    assert entries["escape"].unusable_reason == OUTSIDE_REASON
    assert entries["dotdot"].unusable_reason == OUTSIDE_REASON
    assert entries["real"].usable and entries["inside-link"].usable


def runner_key(serve) -> str:
    """The key serve gave its (loaded) runner, read from the runner's environment."""
    written_through(serve)  # loads the default model's runner
    arbiter, = serve.runner_arbiters()
    return arbiter.environ()[RUNNER_KEY_ENV]


def test_a_runner_serve_started_answers_only_serve(serve):
    key = runner_key(serve)
    url = serve.runner_url()
    for _, command in serve.runner_commands():
        assert key not in command, command  # `ps` shows command lines to every user
        assert "--cors-origins none" in command
    assert runner_headers_of(serve.runner_arbiters()[0].pid) == {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, timeout=60) as local_process:
        assert local_process.get("/health").status_code == 200
        for method, path in (("GET", "/metrics"), ("GET", "/slots"), ("GET", "/props"), ("GET", "/v1/models"),
                             ("POST", "/v1/chat/completions"), ("POST", "/completion")):
            r = local_process.request(method, path, json={**HELLO, "prompt": "hi"} if method == "POST" else None)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        # A page in a browser on this machine gets no CORS answer: it cannot read the runner at all.
        preflight = local_process.options("/v1/chat/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in preflight.headers
    # Serve's own requests carry the key: the relay (answers through the API) and the telemetry scrape.
    r = serve.client.post("/v1/chat/completions", json={**HELLO, "stream": True},
                          headers={"Authorization": f"Bearer {serve.tokens['alice']}"})
    assert r.status_code == 200 and "[DONE]" in r.text
    wait_until(lambda: metric(serve.client, 'hearth:model_kv_used_percent{model="gemma-3-270m-q4_k_m",node="local"}')
               is not None, 20, "serve's sampler never read the runner's /metrics")
    assert metric(serve.client, 'hearth:runner_scrape_failures_total{model="gemma-3-270m-q4_k_m",node="local"}') == 0


def test_secrets_never_appear_in_logs_responses_or_the_store(serve):
    token = serve.tokens["alice"]
    wrong = "hth_" + secrets.token_urlsafe(32)
    pages = []
    for headers in ({"Authorization": f"Bearer {token}"}, {"Authorization": f"Bearer {wrong}"},
                    {"Authorization": wrong}, {"X-Api-Key": token}):
        r = serve.client.post("/v1/chat/completions", json=HELLO, headers=headers)
        pages.append(r.text + str(r.headers))
        r = serve.client.post("/v1/chat/completions", content=b"{bad json", headers=headers)
        pages.append(r.text)
    pages.append(serve.client.get("/metrics").text)
    pages.append(serve.client.get("/v1/models", headers={"Authorization": f"Bearer {token}"}).text)
    pages.append(serve.client.get("/openapi.json").text)
    written_through(serve)
    stored = b"".join(p.read_bytes() for p in serve.data.rglob("*") if p.is_file() and "secrets" not in p.parts)
    log = serve.log_path.read_bytes()
    # The first-run setup code is printed in the log on purpose (whoever reads serve's log runs the
    # box, as with Jenkins' initial admin password); it must still appear nowhere else.
    secret_values = [(token, True), (wrong, True), (runner_key(serve), True)]
    secret_values += [(p.read_text().strip(), p.name != "setup_code") for p in (serve.data / "secrets").glob("*")] \
        if (serve.data / "secrets").is_dir() else []
    for value, kept_out_of_log in secret_values:
        assert value.encode() not in stored
        assert not kept_out_of_log or value.encode() not in log
        assert all(value not in page for page in pages)
