"""Through a real `hearth serve` and its runner on the real Gemma: the KV disk tier's files are owner-only and
name whose request they hold, and a private class's prompts are never written there, not even at shutdown."""

import os
import stat

import pytest

from app.engine.kv_tiers import TMP_PREFIX, entry_owner
from tests.helpers import wait_until

pytestmark = pytest.mark.model


def prompt(topic: str) -> str:
    """~300 tokens: a prefix worth keeping (within SMALL_RUNNERS' cells with the answer), one per topic."""
    return (f"You are the {topic} assistant of a family home. These are the devices of the house:\n"
            + "".join(f"- {topic} device {i} in room {i % 7}: {'on' if i % 2 else 'off'}\n" for i in range(24)))


def entries(data) -> list:
    """The disk tier's written entries: not one still being written (its temporary file is renamed when whole)."""
    return [p for p in (data / "kv-cache").glob("*/*.kv") if not p.name.startswith(TMP_PREFIX)]


def owners(data) -> list:
    """The owners of the disk tier's entries."""
    return sorted(str(entry_owner(p)) for p in entries(data))


def test_the_disk_tier_is_owner_only_knows_whose_words_and_keeps_private_classes_out(start_serve, models_dir):
    old = os.umask(0o022)  # serve inherits it: what it writes must be private anyway
    try:
        s = start_serve(models_dir, classes={"voice": {"private": True}})
    finally:
        os.umask(old)
    body = {"model": "gemma-3-270m-q4_k_m", "max_tokens": 4, "temperature": 0}

    def ask(member: str, topic: str, cls: str) -> None:
        r = s.client.post("/v1/completions", json={**body, "prompt": prompt(topic) + "Question: is device 3 on?"},
                          headers={"Authorization": f"Bearer {s.tokens[member]}", "X-Hearth-Class": cls})
        assert r.status_code == 200, r.text

    ask("kid", "secret", "voice")  # private: kept in memory only
    ask("alice", "kitchen", "chat")
    # Written when the runner goes idle, after the private prompt was cached: alice's file proves the writer has
    # caught up with both.
    wait_until(lambda: owners(s.data) == ["alice"], 60, lambda: f"owners of the written prefixes: {owners(s.data)}")
    (entry,) = entries(s.data)
    for path, mode in ((s.data, 0o700), (s.data / "kv-cache", 0o700), (entry.parent, 0o700), (entry, 0o600),
                       (s.data / "hearth.db", 0o600)):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    s.stop()  # the runner writes what the disk lacks before it exits: never the private prompt
    assert owners(s.data) == ["alice"]
