"""Fill-in-the-middle on a tiny generated GGUF that has FIM tokens: /v1/completions with suffix, /infill, raw FIM prompts."""

import json

import pytest
from tiny_gguf import FIM, write_tiny_model

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def fim_runner(tmp_path_factory, runner_class):
    d = tmp_path_factory.mktemp("fim")
    runner = runner_class(write_tiny_model(d / "tiny-fim.gguf"), d / "runner.log", "--ctx", "512", "--parallel", "2")
    yield runner.wait_ready()
    runner.stop()


def ids(runner, text: str) -> list[int]:
    return runner.client.post("/tokenize", json={"content": text}).json()["tokens"]


def test_raw_prompts_tokenize_fim_markers_as_special_tokens(fim_runner):
    props = fim_runner.client.get("/props").json()
    assert props["fim_tokens"] == ["mid", "pre", "suf"]
    pre, suf, mid = (ids(fim_runner, FIM[k]) for k in ("pre", "suf", "mid"))
    assert len(pre) == len(suf) == len(mid) == 1
    raw = ids(fim_runner, f"{FIM['pre']}def f(x){FIM['suf']}return x{FIM['mid']}")
    assert raw[0] == pre[0] and suf[0] in raw and raw[-1] == mid[0]
    prompt = f"{FIM['pre']}a{FIM['suf']}b{FIM['mid']}"
    r = fim_runner.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
    # BOS, then the same tokens /tokenize gives: the markers were not spelled out as text.
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1 + len(ids(fim_runner, prompt))


def test_completion_with_suffix_is_laid_out_in_fim_tokens(fim_runner):
    prefix, suffix = "def f(x):", "return x"
    r = fim_runner.client.post("/v1/completions", json={"prompt": prefix, "suffix": suffix, "max_tokens": 3,
                                                         "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    n_text = len(ids(fim_runner, prefix)) + len(ids(fim_runner, suffix))
    assert body["usage"]["prompt_tokens"] == 1 + 3 + n_text  # BOS, pre/suf/mid, the two texts
    assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["finish_reason"] in ("length", "stop")


def test_infill_answers_like_llama_server_streamed_and_not(fim_runner):
    req = {"input_prefix": "def f(x):\n    ", "input_suffix": "\n", "input_extra": [{"filename": "a.py", "text": "x=1"}],
           "n_predict": 4, "temperature": 0}
    whole = fim_runner.client.post("/infill", json=req).json()
    assert whole["stop"] is True and whole["tokens_predicted"] >= 1 and isinstance(whole["content"], str)
    assert whole["tokens_predicted"] <= 4 and whole["tokens_evaluated"] > 4  # llama-server's counts, no usage
    with fim_runner.client.stream("POST", "/infill", json={**req, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["stop"] is True and all(not e["stop"] for e in events[:-1])
    assert "".join(e["content"] for e in events) == whole["content"]


def test_a_model_without_fim_tokens_says_so(runner):
    r = runner.client.post("/v1/completions", json={"prompt": "def f(", "suffix": ")", "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "fim_unsupported" and "fill-in-the-middle" in r.json()["error"]["message"]
    r = runner.client.post("/infill", json={"input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_suffix"
