"""The gateway's shared `hearth serve` (real runners on the real Gemma GGUF), with tight classes for queue tests."""

import pytest


@pytest.fixture(scope="session")
def serve(start_shared_serve, models_dir):
    """The shared serve: small runners, a tight 'coding' class for queue tests, tokens."""
    s = start_shared_serve(
        models_dir,
        # coding's queue timeout outlasts the request it waits behind even on a loaded 2-core box.
        classes={"coding": {"max_concurrent": 1, "max_queue": 1, "queue_timeout_s": 600},
                 "documents": {"max_concurrent": 1, "max_queue": 4, "queue_timeout_s": 0.5}},
        settings={"runner_ctx": 1024, "runner_parallel": 4, "runner_threads": 2},
        tokens=[("alice", "chat", ["voice", "coding", "documents"]), ("kid", "voice", [])],
    )
    yield s
    s.stop()
