"""The writers' encoded fast path: a plain token's chunk written as bytes is the event json.dumps of its dict gives."""

from __future__ import annotations

import pytest

from app.engine.model_config import ModelConfig
from app.engine.request import Delta, SamplingParams
from app.protocols import sse
from app.runner.app import create_app
from app.runner.config import RunnerConfig
from app.runner.job import CHAT, TEXT, Job
from app.runner.writers import writer_for
from tests.engine.fake_model import FakeTextModel

TEXTS = ["Hi", ' "quoted" ', "back\\slash", "line\nbreak\ttab", "\x01\x1f", "é ü 漢字", "😀", "</script>", "\u2028",
         " ", "\x7f"]


@pytest.fixture(scope="module")
def state():
    model = FakeTextModel(n_ctx=256, n_batch=64, n_seq_max=2)
    app = create_app(RunnerConfig(ModelConfig(path="/models/fake.gguf", n_ctx=256, n_seq_max=2)), load=False,
                     backend=lambda _: model)
    app.state.load()
    yield app.state
    app.state.engine.stop()


@pytest.mark.parametrize("kind", [TEXT, CHAT])
@pytest.mark.parametrize("timed", [False, True])
def test_a_plain_tokens_event_is_the_bytes_of_its_chunk(state, kind, timed):
    job = Job(kind=kind, tokens=tuple(range(7)), params=SamplingParams(), rid="cmpl-x\"y", stream=True,
              timings_per_token=timed)
    fast, slow = writer_for(job, state, encoded=True), writer_for(job, state)
    fast.created = slow.created
    for i, text in enumerate(TEXTS):
        # The prompt's figures change once (a prompt of 3 cached tokens, then its time), the tokens' every time.
        ev = Delta(text, 1, None, (i,), 1, 3 if i else 0, 2.5 if i < 4 else 1e-7, [0.0, 0.1, 1 / 3, 12345.678][i % 4])
        got, want = fast.delta(ev), slow.delta(ev)
        assert len(got) == len(want) == 1 and isinstance(got[0], bytes)
        assert got[0] == sse.encode(want[0]), text


def test_logprobs_and_parsed_answers_keep_the_dict_path(state):
    job = Job(kind=TEXT, tokens=(1, 2), params=SamplingParams(), rid="cmpl-1", stream=True, logprobs=True)
    writer = writer_for(job, state, encoded=True)
    piece = writer.delta(Delta("a", 1, {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}, (5,)))
    assert isinstance(piece[0], dict) and piece[0]["choices"][0]["logprobs"]["tokens"] == ["a"]
