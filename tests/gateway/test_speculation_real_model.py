"""Speculative decoding through a real `hearth serve` on the real Gemma: serve starts the runner with
--spec-type ngram-lookup (auto), a request whose answer repeats its context drafts and the request log keeps
the runner's counts, and a class switched off sends the runner no drafts."""

from __future__ import annotations

from app.admin import update_class
from app.store.db import open_store, writing_sessions
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


def _switch(serve, name: str, value: bool) -> None:
    engine, _ = open_store(serve.data)
    try:
        with writing_sessions(engine)() as s:
            update_class(s, name, {"speculation": "on" if value else "off"})
            s.commit()
    finally:
        engine.dispose()


def test_auto_drafts_from_the_context_and_a_class_switched_off_does_not(serve):
    db = serve.data / "hearth.db"
    commands = [cmd for _, cmd in serve.runner_commands()]
    assert commands and all("--spec-type ngram-lookup" in cmd for cmd in commands)

    def completed(klass: str) -> tuple[dict, tuple]:
        # The serve is shared: earlier tests' rows are in the log, so only a row after this point is ours.
        before = query(db, "select coalesce(max(id), 0) from requests")[0][0]
        answer = _complete(serve, klass)
        row = wait_until(lambda: query(db, "select draft_tokens, draft_accepted from requests where id > ? and "
                                           "class_name = ? and status = 'ok'", before, klass),
                         message=f"the {klass} row")
        return answer, row[0]

    # The shared serve has drafting off in every class; chat is switched on here. The gateway reads classes
    # through a cache of a few seconds: wait for the switch to reach it.
    _switch(serve, "chat", True)
    try:
        def drafted_answer():
            answer, (draft_tokens, accepted) = completed("chat")
            return (answer, draft_tokens, accepted) if draft_tokens else None

        drafted, draft_tokens, accepted = wait_until(drafted_answer, timeout_s=60, message="a chat request with drafts")
    finally:
        _switch(serve, "chat", False)
    assert drafted["timings"].get("draft_n") == draft_tokens and 0 <= accepted <= draft_tokens
    plain, (none, _) = completed("documents")
    assert none is None and "draft_n" not in plain["timings"]
    # Greedy output is the same with drafts and without (a confident copy: no near-tie to flip).
    assert plain["choices"][0]["text"] == drafted["choices"][0]["text"]
