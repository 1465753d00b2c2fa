"""Through `hearth serve`: two local runners share the CPU, and while one serves an urgent (chat, as voice) request
the other's background work pauses (serve's CoreShare, POST /hearth/hold), then finishes whole. The embedded model runs the
background request; a tiny random model takes the urgent one."""

import threading

import httpx
import pytest

from app.devtools.gguf_shapes import SHAPES, make_model
from app.devtools.serve_process import runner_headers_of
from app.exposition import parse_exposition
from tests.helpers import SMALL_RUNNERS, wait_until

pytestmark = pytest.mark.model

GEMMA = "gemma-3-270m-q4_k_m"
BACKGROUND_TOKENS = 160


def _runner(s, model_file: str) -> tuple[str, dict]:
    """The URL and key of the runner serving `model_file`."""
    for p in s.runner_arbiters():
        args = p.cmdline()
        if any(a.endswith(model_file) for a in args):
            return f"http://127.0.0.1:{args[args.index('--port') + 1]}", runner_headers_of(p.pid)
    raise LookupError(f"no runner for {model_file}")


def _metric(url: str, headers: dict, name: str) -> float:
    """A runner's counter; 0 while it is still starting (not listening yet, or loading)."""
    try:
        r = httpx.get(url + "/metrics", headers=headers, timeout=30)
    except httpx.ConnectError:
        return 0.0
    if r.status_code != 200:
        return 0.0
    return sum(value for _, value in parse_exposition(r.text).series(name))


def test_an_urgent_request_on_one_model_pauses_background_work_on_another_which_then_finishes(start_serve, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    make_model(SHAPES["tiny"], models / "tiny.gguf")
    s = start_serve(models, tokens=[("alice", "voice", ["chat"]), ("bg", "background", [])],
                    settings={**SMALL_RUNNERS, "runner_ctx": 2048})
    urgent = {"Authorization": f"Bearer {s.tokens['alice']}"}
    bg = {"Authorization": f"Bearer {s.tokens['bg']}"}
    warm = s.client.post("/v1/completions", headers=urgent, json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert warm.status_code == 200, warm.text
    result: dict = {}

    def background() -> None:
        body = {"model": GEMMA, "prompt": "Write a long story about a lighthouse:", "max_tokens": BACKGROUND_TOKENS,
                "ignore_eos": True, "temperature": 0}
        r = httpx.post(s.url + "/v1/completions", headers=bg, json=body, timeout=300)
        result["status"] = r.status_code
        result["tokens"] = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else r.text

    thread = threading.Thread(target=background)
    thread.start()
    try:
        gemma_url, gemma_key = wait_until(lambda: _try_runner(s, f"{GEMMA}.gguf"), 120, "the embedded model's runner")
        wait_until(lambda: _metric(gemma_url, gemma_key, "llamacpp:tokens_predicted_total") >= 8, 120,
                   "the background stream to decode")
        # A chat answer (not preemptible, more urgent than background, as voice is) long enough to span a few of the
        # background runner's iterations: the tiny model's tokens are cheap, and voice's cap is 256.
        r = s.client.post("/v1/completions", headers=urgent, json={
            "model": "tiny", "prompt": "Tell me about the kitchen light", "max_tokens": 1000, "ignore_eos": True,
            "hearth_class": "chat"})
        assert r.status_code == 200, r.text
        # The background runner paused for the voice request and was told to go on after it.
        held = wait_until(lambda: _metric(gemma_url, gemma_key, "hearth:held_seconds_total"), 30,
                          "the background runner to have paused")
        assert held > 0
    finally:
        thread.join(300)
    assert result == {"status": 200, "tokens": BACKGROUND_TOKENS}
    tiny_url, tiny_key = _runner(s, "tiny.gguf")
    assert _metric(tiny_url, tiny_key, "hearth:held_seconds_total") == 0


def _try_runner(s, model_file: str):
    try:
        return _runner(s, model_file)
    except LookupError:
        return None
