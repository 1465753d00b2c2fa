"""One image, one question, greedy, through a real `hearth serve` (a copy of the embedded Gemma 3 270M with its
random projector beside it, paired by name): OpenAI chat, Ollama chat and generate, Anthropic messages and
Responses give the same generated text, the same number of generated tokens and the same total prompt tokens,
and so does the serve's runner's own llama-server /completion of the prompt its /apply-template renders with the
image as multimodal_data (issue 31's first target, kept on every run without stock llama-server). Where stock
llama-server is built it answers the same, started with the runner's flags and chat template."""

from __future__ import annotations

import base64
import re
import shutil

import httpx
import pytest

from app.devtools.mmproj import cached_mmproj
from app.devtools.parity.vision_bench import stock_beside
from app.llama_tools import stock_llama_server
from tests.images import data_url, image_bytes

VISION = "gemma-parity-Q4_K_M"
QUESTION = "What is in this picture?"
MAX_TOKENS = 16
# The image before the text in every API: Ollama's `images` have no place of their own and its prompt puts them
# first (app/protocols/ollama.py), so the others are sent in that order.
IMAGE = image_bytes("JPEG", size=(96, 64), seed=11)
B64 = base64.b64encode(IMAGE).decode()
OPENAI_MESSAGE = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMAGE, "image/jpeg")}},
                                              {"type": "text", "text": QUESTION}]}


@pytest.fixture(scope="module")
def pserve(start_shared_serve, tmp_path_factory, gemma_path):
    """A serve whose models folder holds a copy of Gemma and the random projector named after it."""
    models = tmp_path_factory.mktemp("parity-models")
    # A copy, not a link: the catalog lists one file once, however many names it has.
    shutil.copyfile(gemma_path, models / f"{VISION}.gguf")
    shutil.copyfile(cached_mmproj(gemma_path), models / f"mmproj-{VISION}-f32.gguf")
    return start_shared_serve(models=models)


def _post(serve, path: str, body: dict) -> dict:
    r = serve.client.post(path, headers={"Authorization": f"Bearer {serve.tokens['alice']}"}, json=body)
    assert r.status_code == 200, (path, r.text[:500])
    return r.json()


@pytest.fixture(scope="module")
def answers(pserve) -> dict[str, tuple[str, int, int]]:
    """API → (generated text, total prompt tokens, generated tokens) for the same image and question."""
    out = {}
    a = _post(pserve, "/v1/chat/completions", {"model": VISION, "max_tokens": MAX_TOKENS, "temperature": 0,
                                               "messages": [OPENAI_MESSAGE]})
    out["openai"] = (a["choices"][0]["message"]["content"], a["usage"]["prompt_tokens"], a["usage"]["completion_tokens"])
    ollama = {"model": VISION, "stream": False, "options": {"temperature": 0, "num_predict": MAX_TOKENS}}
    a = _post(pserve, "/api/chat", {**ollama, "messages": [{"role": "user", "content": QUESTION, "images": [B64]}]})
    out["ollama chat"] = (a["message"]["content"], a["prompt_eval_count"], a["eval_count"])
    a = _post(pserve, "/api/generate", {**ollama, "prompt": QUESTION, "images": [B64]})
    out["ollama generate"] = (a["response"], a["prompt_eval_count"], a["eval_count"])
    a = _post(pserve, "/v1/messages", {"model": VISION, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                                                   "data": B64}},
                                     {"type": "text", "text": QUESTION}]}]})
    u = a["usage"]
    # Anthropic's input_tokens leave out what the prompt cache gave: the total adds it back.
    out["anthropic"] = ("".join(b["text"] for b in a["content"] if b["type"] == "text"),
                        u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"],
                        u["output_tokens"])
    a = _post(pserve, "/v1/responses", {"model": VISION, "max_output_tokens": MAX_TOKENS, "temperature": 0, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(IMAGE, "image/jpeg")},
                                     {"type": "input_text", "text": QUESTION}]}]})
    out["responses"] = ("".join(c["text"] for item in a["output"] if item["type"] == "message"
                                for c in item["content"] if c["type"] == "output_text"),
                        a["usage"]["input_tokens"], a["usage"]["output_tokens"])
    return out


def test_every_api_gives_the_same_greedy_answer_and_prompt_tokens(answers):
    text, n_prompt, n_generated = answers["openai"]
    assert text and n_generated > 0
    # The image's tokens are in the count: far more than the question's few words.
    assert n_prompt > 16 + len(QUESTION.split())
    for api, answer in answers.items():
        assert answer == (text, n_prompt, n_generated), api


def test_the_runners_own_completion_of_the_rendered_prompt_gives_the_same(pserve, answers):
    runner, headers = pserve.runner_url(), pserve.runner_headers()
    with httpx.Client(base_url=runner, headers=headers, timeout=120) as c:
        prompt = c.post("/apply-template", json={"messages": [OPENAI_MESSAGE]}).json()["prompt"]
        assert prompt.count("<__media__>") == 1 and prompt.index("<__media__>") < prompt.index(QUESTION)
        r = c.post("/completion", json={"prompt": {"prompt_string": prompt, "multimodal_data": [B64]},
                                        "n_predict": MAX_TOKENS, "temperature": 0, "return_tokens": True})
        assert r.status_code == 200, r.text[:500]
        native = r.json()
        words = c.post("/detokenize", json={"tokens": native["tokens"]}).json()["content"]
        # The prompt's text in an answer leaves the image's positions out (they are no tokens): before, the
        # native answer's `prompt` and a verbose chat answer handed them to llama.cpp, which aborted the runner.
        verbose = c.post("/v1/chat/completions", json={"max_tokens": 2, "temperature": 0, "verbose": True,
                                                       "messages": [OPENAI_MESSAGE]})
        assert verbose.status_code == 200, verbose.text[:500]
    text, n_prompt, n_generated = answers["openai"]
    assert (native["content"], native["tokens_evaluated"], native["tokens_predicted"]) == (text, n_prompt, n_generated)
    assert len(native["tokens"]) == n_generated and words == text
    assert QUESTION in native["prompt"] and "<start_of_image><end_of_image>" in native["prompt"]
    assert QUESTION in verbose.json()["__verbose"]["prompt"]


def test_stock_llama_server_with_the_runners_flags_and_template_gives_the_same(pserve, answers, tmp_path):
    binary = stock_llama_server()
    if binary is None:
        pytest.skip("stock llama-server is not built (scripts/build_llama_tools.sh)")
    proc, client, held = stock_beside(pserve, VISION, binary, tmp_path)
    try:
        # The same prompt text first (both strip the BOS the template writes), then the same answer. llama-server's
        # /apply-template writes its marker with a random tail (<__media_…__>): the marker's place is compared.
        theirs_prompt = re.sub(r"<__media_\w+__>", "<__media__>", client.post(
            "/apply-template", json={"messages": [OPENAI_MESSAGE]}).json()["prompt"])
        ours_prompt = httpx.post(f"{pserve.runner_url()}/apply-template", headers=pserve.runner_headers(),
                                 json={"messages": [OPENAI_MESSAGE]}, timeout=60).json()["prompt"]
        assert theirs_prompt == ours_prompt
        r = client.post("/v1/chat/completions", json={"max_tokens": MAX_TOKENS, "temperature": 0,
                                                      "messages": [OPENAI_MESSAGE]})
        assert r.status_code == 200, r.text[:500]
        theirs = r.json()
        # The same generated token ids from both /completion routes, for the same prompt text and image, each
        # prompt_string with the marker its server's /props names (llama-server's is random per process).
        body = {"n_predict": MAX_TOKENS, "temperature": 0, "return_tokens": True}
        stock_marker = client.get("/props").json()["media_marker"]
        stock_native = client.post("/completion", json={**body, "prompt": {
            "prompt_string": ours_prompt.replace("<__media__>", stock_marker), "multimodal_data": [B64]}}).json()
        ours_props = httpx.get(f"{pserve.runner_url()}/props", headers=pserve.runner_headers(), timeout=60).json()
        ours_native = httpx.post(f"{pserve.runner_url()}/completion", headers=pserve.runner_headers(), json={
            **body, "prompt": {"prompt_string": ours_prompt.replace("<__media__>", ours_props["media_marker"]),
                               "multimodal_data": [B64]}}, timeout=120).json()
    finally:
        client.close()
        proc.terminate()
        proc.wait(15)
    assert held["template_is_builtin_gemma3"]  # the embedded GGUF has no template: Hearth's own for Gemma 3
    assert (theirs["choices"][0]["message"]["content"], theirs["usage"]["prompt_tokens"],
            theirs["usage"]["completion_tokens"]) == answers["openai"]
    assert ours_native["tokens"] == stock_native["tokens"] and len(stock_native["tokens"]) == MAX_TOKENS
    assert ours_native["tokens_evaluated"] == stock_native["tokens_evaluated"] == answers["openai"][1]
