"""Speculative decoding through a real `hearth serve` on the real Gemma: serve starts the runner with
--spec-type ngram-lookup (auto), a request whose answer repeats its context drafts and the request log keeps
the runner's counts, and a class switched off sends the runner no drafts."""

from __future__ import annotations

from app.admin import update_class
from app.store.db import open_store
from tests.helpers import query, wait_until

# A list the model is asked to copy: its continuation is in the context, so n-gram lookup has drafts to offer.
LIST = ", ".join(f"item {i}" for i in range(1, 41))
PROMPT = f"Copy this list exactly.\nList: {LIST}\nCopy: {LIST}\nList: {LIST}\nCopy:"


def _complete(serve, klass: str) -> dict:
    r = serve.client.post("/v1/completions", headers={"Authorization": f"Bearer {serve.tokens['alice']}",
                                                      "X-Hearth-Class": klass},
                          json={"prompt": PROMPT, "max_tokens": 48, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _switch(serve, name: str, value: str) -> None:
    engine, sessions = open_store(serve.data)
    try:
        with sessions() as s:
            update_class(s, name, {"speculation": value})
            s.commit()
    finally:
        engine.dispose()


def test_auto_drafts_from_the_context_and_a_class_switched_off_does_not(serve):
    db = serve.data / "hearth.db"
    # The serve is shared: earlier tests' chat rows are in the log, so only a row after this point is ours.
    before = query(db, "select coalesce(max(id), 0) from requests")[0][0]
    drafted = _complete(serve, "chat")
    commands = [cmd for _, cmd in serve.runner_commands()]
    assert commands and all("--spec-type ngram-lookup" in cmd for cmd in commands)
    rows = wait_until(lambda: query(db, "select draft_tokens, draft_accepted from requests where id > ? and "
                                        "class_name = 'chat' and status = 'ok'", before), message="the chat row")
    assert drafted["timings"].get("draft_n") == rows[0][0]
    assert rows[0][0] and rows[0][0] > 0 and 0 <= rows[0][1] <= rows[0][0]
    _switch(serve, "documents", "off")
    # The gateway reads classes through a cache of a few seconds: wait for the switch to reach it.
    def undrafted():
        before = query(db, "select max(id) from requests")[0][0]
        plain = _complete(serve, "documents")
        row = wait_until(lambda: query(db, "select draft_tokens from requests where id > ? and class_name = "
                                           "'documents'", before), message="the documents row")
        return plain if row[0][0] is None else None

    try:
        plain = wait_until(undrafted, timeout_s=60, message="a documents request without drafts")
    finally:
        _switch(serve, "documents", "on")  # the serve is shared by the session's gateway tests
    # Greedy output is the same with drafts and without.
    assert plain["choices"][0]["text"] == drafted["choices"][0]["text"]
