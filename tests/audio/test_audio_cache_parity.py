"""Audio and the prefix cache (issue 53): the same sequence of requests on `hearth runner` and on stock llama-server,
with the same model, random audio projector, template and cache layout (`--swa-full -kvu -b 512`), gives identical
tokens and text for every request.

The sequence is the one that parted them: a transcription, a chat with text then audio, a chat with audio then text,
and the same audio chat again (its prompt all cached but the last token). What parted them was where a request's
cells lay in the unified KV cache: llama.cpp's attention rounds by cell index and by the extent of the cells in use,
and Hearth kept earlier requests' cells where llama-server's slot overwrites them, so the random model's greedy
near-ties tipped. A runner with a RAM tier now gives a request that runs alone the cache to itself, as llama-server's
slot has it (app.engine.scheduler.Scheduler._cache_to_itself).
"""

from __future__ import annotations

import base64
import io

import pytest
from werkzeug.test import Client

from app.devtools import audio_files
from app.devtools.audio_mmproj import cached_audio_mmproj
from app.devtools.gguf_shapes import CHATML_TEMPLATE
from app.engine.model_config import ModelConfig
from app.protocols.audio import AudioLimits
from app.runner.app import create_app
from app.runner.config import RunnerConfig
from tests.e2e.test_compat_http import _stock_with_projector
from tests.helpers import wait_until
from tests.runner.loaded import LOAD_TIMEOUT_S

pytestmark = pytest.mark.skipif(bool(audio_files.encoders_missing()), reason="apt-get install flac lame")

SHAPE = "mmproj-qwen2a-tiny"
FORM = {"model": "m", "temperature": "0", "max_tokens": "12"}
ASK = "What is in this recording?"


@pytest.fixture(scope="module")
def projector(gemma_path):
    return cached_audio_mmproj(gemma_path, SHAPE)


@pytest.fixture
def stock(gemma_path, projector, tmp_path):
    """A fresh stock llama-server for one sequence (its slot and prompt cache carry the history)."""
    yield from _stock_with_projector(gemma_path, projector, tmp_path)


@pytest.fixture(params=[1, 2], ids=["slots1", "slots2"])
def runner(request, gemma_path, projector):
    """A fresh runner with a RAM tier, as `hearth runner` and serve start one (-cram), on the stock server's layout."""
    config = RunnerConfig(ModelConfig(path=str(gemma_path), n_ctx=2048, n_seq_max=request.param, n_threads=2,
                                      n_batch=512, kv_transfer=True),
                          mmproj=str(projector), chat_template=CHATML_TEMPLATE, audio=AudioLimits(max_seconds=40.0),
                          cache_ram_mib=256)
    app = create_app(config)
    wait_until(lambda: app.state.status != "loading", LOAD_TIMEOUT_S, "the runner never finished loading")
    assert app.state.status == "ok", app.state.error
    yield Client(app)
    app.state.engine.stop()
    app.state.model.close()


def _chat(audio: bytes, audio_first: bool) -> dict:
    parts = [{"type": "text", "text": ASK},
             {"type": "input_audio", "input_audio": {"data": base64.b64encode(audio).decode(), "format": "wav"}}]
    return {"temperature": 0, "max_tokens": 24, "logprobs": True,
            "messages": [{"role": "user", "content": parts[::-1] if audio_first else parts}]}


def _tokens(answer: dict) -> list:
    """The generated tokens, as each server names them in its logprobs."""
    return [(e.get("id"), e["token"]) for e in answer["choices"][0]["logprobs"]["content"]]


def test_the_sequence_answers_as_stock_llama_server_token_for_token(runner, stock, gemma_path):
    audio = audio_files.sweep("wav", seconds=2.5)
    ours = runner.post("/v1/audio/transcriptions", data={**FORM, "file": (io.BytesIO(audio), "clip.wav")},
                       content_type="multipart/form-data")
    theirs = stock.post("/v1/audio/transcriptions", data=FORM, files={"file": ("clip.wav", audio)})
    assert ours.status_code == theirs.status_code == 200, (ours.get_json(), theirs.text)
    a, b = ours.get_json(), theirs.json()
    assert (a["text"], a["usage"]["input_tokens"]) == (b["text"], b["usage"]["input_tokens"])
    for name, audio_first in (("text then audio", False), ("audio then text", True), ("the same again", True)):
        r = runner.post("/v1/chat/completions", json=_chat(audio, audio_first))
        assert r.status_code == 200, r.get_json()
        a = r.get_json()
        b = stock.post("/v1/chat/completions", json=_chat(audio, audio_first)).json()
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"], name
        # Both reuse the same prefix of the history: the header, then all but the last token of the repeated chat.
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == b["timings"]["cache_n"], name
        ids = [i for i, _ in _tokens(a)]
        theirs_tokens = _tokens(b) if all(i is not None for i, _ in _tokens(b)) else None
        assert theirs_tokens is None or ids == [i for i, _ in theirs_tokens], name
        assert [t for _, t in _tokens(a)] == [t for _, t in _tokens(b)], name
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"], name
