"""The runner hands the engine whose request it is and whether its class is private (hearth_member and
hearth_private, set by the gateway), so the cells it leaves in the prefix cache carry them to the KV tiers."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_the_engine_gets_the_member_and_the_private_flag(make_runner, path, body):
    client = make_runner()
    engine = client.application.state.engine
    seen = []
    real = engine.submit

    def submit(*args, **kwargs):
        seen.append((kwargs.get("owner"), kwargs.get("private")))
        return real(*args, **kwargs)

    engine.submit = submit
    assert client.post(path, json={**body, "max_tokens": 2}).status_code == 200
    assert seen[-1] == (None, False)  # a client talking to the runner directly: nobody's, not private
    r = client.post(path, json={**body, "max_tokens": 2, "hearth_member": "alice", "hearth_private": True})
    assert r.status_code == 200 and seen[-1] == ("alice", True)
