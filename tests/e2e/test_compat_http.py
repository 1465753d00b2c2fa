"""Other vendors' clients against a real `hearth runner` on loopback: Anthropic's SDK on /v1/messages,
OpenAI's SDK on /v1/responses, and /rerank checked against stock llama-server on the same model."""

import math
import threading

import anthropic
import httpx
import openai
import pytest
from werkzeug.serving import make_server

from app.devtools.stock_server import StockServer
from app.engine.model_config import ModelConfig
from app.llama_tools import stock_llama_server
from app.runner.app import create_app
from app.runner.config import RunnerConfig
from tests.helpers import wait_until

# A small model fills a city in a few tokens; an arithmetic expression it can repeat until max_tokens.
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK_WEATHER = "What's the weather in Paris?"
# Anthropic's SDK no longer takes sampling arguments; the API (and the runner) still read them from the body.
GREEDY = {"temperature": 0}
DOCS = ["A machine is a physical system that uses power.", "Learning is the process of acquiring new understanding.",
        "Machine learning is a field of study in artificial intelligence.",
        "Paris, capitale de la France, est une grande ville."]


@pytest.fixture(scope="module")
def claude(runner):
    with anthropic.Anthropic(api_key="unused", base_url=runner.url, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def oai(runner):
    with openai.OpenAI(api_key="unused", base_url=runner.url + "/v1", max_retries=0) as client:
        yield client


def test_anthropic_sdk_message(claude, runner):
    msg = claude.messages.create(model="any", max_tokens=8, extra_body=GREEDY, system="Be brief.",
                                 messages=[{"role": "user", "content": "Say hello"}])
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and 0 < msg.usage.output_tokens <= 8
    # The same conversation through the chat route costs the same prompt.
    chat = runner.client.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}],
        "max_tokens": 1}).json()
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    counted = claude.messages.count_tokens(model="any", system="Be brief.",
                                           messages=[{"role": "user", "content": "Say hello"}])
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


def test_anthropic_sdk_stream_accumulates_to_the_final_message(claude):
    with claude.messages.stream(model="any", max_tokens=12, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Count to five"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.usage.output_tokens > 0 and final.stop_reason in ("end_turn", "max_tokens")


def test_anthropic_sdk_tool_use_round_trip(claude):
    ask = [{"role": "user", "content": ASK_WEATHER}]
    msg = claude.messages.create(model="any", max_tokens=80, extra_body=GREEDY, tools=[WEATHER],
                                 tool_choice={"type": "any"}, messages=ask)
    assert msg.stop_reason == "tool_use"
    use = next(b for b in msg.content if b.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input, dict) and "city" in use.input
    # Streamed, the SDK rebuilds the same kind of block from input_json_delta events.
    with claude.messages.stream(model="any", max_tokens=80, extra_body=GREEDY, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}, messages=ask) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].type == "tool_use"
    assert "city" in streamed.content[-1].input
    answer = claude.messages.create(model="any", max_tokens=10, extra_body=GREEDY, tools=[WEATHER], messages=[
        *ask, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 25 C"}]}])
    assert answer.type == "message"


def test_anthropic_sdk_errors(claude):
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(model="any", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    assert exc.value.body["error"]["type"] == "invalid_request_error"
    too_long = "word " * 3000
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="any", max_tokens=5, messages=[{"role": "user", "content": too_long}])


def _cancelled(runner) -> float:
    """Requests the runner has finished as cancelled so far."""
    for line in runner.client.get("/metrics").text.splitlines():
        if line.startswith('hearth:requests_finished_total{reason="cancelled"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_client_leaving_an_anthropic_stream_cancels_its_generation(runner):
    before = _cancelled(runner)
    body = {"model": "any", "max_tokens": 2000, "messages": [{"role": "user", "content": "Tell a long story"}],
            "stream": True}
    with httpx.Client(base_url=runner.url, timeout=60) as c, c.stream("POST", "/v1/messages", json=body) as resp:
        deltas = 0
        for line in resp.iter_lines():
            deltas += line == "event: content_block_delta"
            if deltas == 3:
                break
    # The translated stream is closed with the connection, and the chat route under it cancels.
    wait_until(lambda: _cancelled(runner) > before, timeout_s=30, message="the abandoned generation to be cancelled")
    wait_until(lambda: not any(s["is_processing"] for s in runner.client.get("/slots").json()), timeout_s=30,
               message="its slot to be freed")


def test_openai_sdk_responses(oai):
    res = oai.responses.create(model="any", instructions="Be brief.", input="Say hello", max_output_tokens=8,
                               temperature=0)
    assert res.id.startswith("resp_") and res.output[0].id.startswith("msg_")
    assert res.output_text and 0 < res.usage.output_tokens <= 8
    gathered, completed, msg_id = "", None, None
    for event in oai.responses.create(model="any", input=[{"role": "system", "content": "Be brief."},
                                                          {"role": "user", "content": "Say hello"}],
                                      max_output_tokens=8, temperature=0, stream=True):
        if event.type == "response.output_item.added":
            msg_id = event.item.id
        if event.type == "response.output_text.delta":
            assert event.item_id == msg_id
            gathered += event.delta
        if event.type == "response.completed":
            completed = event.response
    assert completed is not None and gathered == completed.output_text == res.output_text


def test_openai_sdk_responses_function_call_round_trip(oai):
    tool = {"type": "function", "name": "get_weather", "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}
    res = oai.responses.create(model="any", input=ASK_WEATHER, tools=[tool], tool_choice="required",
                               max_output_tokens=80, temperature=0)
    call = next(item for item in res.output if item.type == "function_call")
    assert call.name == "get_weather" and "city" in call.arguments
    follow = oai.responses.create(model="any", tools=[tool], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": ASK_WEATHER},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 25 C"}])
    assert follow.status == "completed"
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="any", input="hi", previous_response_id="resp_123")


@pytest.fixture(scope="module")
def reranker(gemma_path):
    """A runner in reranking mode, served in this process over loopback HTTP."""
    config = RunnerConfig(ModelConfig(path=str(gemma_path), n_ctx=1024, n_seq_max=1, n_threads=2), reranking=True)
    server = make_server("127.0.0.1", 0, create_app(config), threaded=True)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    client = httpx.Client(base_url=f"http://127.0.0.1:{server.server_port}", timeout=120)
    wait_until(lambda: client.get("/health").status_code == 200, timeout_s=120, message="the reranker to load")
    yield client
    client.close()
    server.shutdown()


def test_rerank_shapes(reranker):
    jina = reranker.post("/rerank", json={"query": "Machine learning is", "documents": DOCS, "top_n": 3}).json()
    scores = [r["relevance_score"] for r in jina["results"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    assert jina["usage"]["prompt_tokens"] == jina["usage"]["total_tokens"] > 0
    tei = reranker.post("/v1/rerank", json={"query": "Machine learning is", "texts": DOCS, "return_text": True}).json()
    assert [r["index"] for r in tei][:3] == [r["index"] for r in jina["results"]]
    assert all(r["text"] == DOCS[r["index"]] for r in tei)


def test_rerank_scores_are_stock_llama_servers(reranker, gemma_path, tmp_path):
    binary = stock_llama_server()
    if binary is None:
        pytest.skip("stock llama-server is not built (scripts/build_llama_tools.sh)")
    proc, stock = _stock_server(binary, gemma_path, tmp_path / "llama-server.log", "--reranking")
    try:
        body = {"query": "Machine learning is", "documents": DOCS}
        theirs = stock.post("/rerank", json=body).json()
        ours = reranker.post("/rerank", json=body).json()
    finally:
        stock.close()
        proc.stop()
    assert ours["usage"] == theirs["usage"]
    assert [r["index"] for r in ours["results"]] == [r["index"] for r in theirs["results"]]
    for a, b in zip(ours["results"], theirs["results"]):
        assert a["relevance_score"] == pytest.approx(b["relevance_score"], rel=1e-3, abs=1e-3)


def _stock_server(binary, gemma_path, log_path, *args: str) -> tuple[StockServer, httpx.Client]:
    """Stock llama-server on the same model (the product's repack rule and Hearth's cache layout), started and healthy."""
    server = StockServer(binary, gemma_path, "-t", "2", "-c", "1024", "-np", "1", *args, log_path=log_path).start()
    return server, server.client


def _stock_with_projector(gemma_path, projector, folder):
    """Stock llama-server with the same model, projector and ChatML template as a Hearth runner's multimodal tests,
    yielded as a client and stopped after (skipped where it is not built). A fixture body: `yield from` it."""
    from app.devtools.gguf_shapes import CHATML_TEMPLATE

    binary = stock_llama_server()
    if binary is None:
        pytest.skip("stock llama-server is not built (scripts/build_llama_tools.sh)")
    template = folder / "chatml.jinja"
    template.write_text(CHATML_TEMPLATE)
    proc, client = _stock_server(binary, gemma_path, folder / "llama-server.log", "--mmproj", str(projector),
                                 "--jinja", "--chat-template-file", str(template), "-c", "2048")
    yield client
    client.close()
    proc.stop()


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_with_pooling_are_stock_llama_servers(pooling, gemma_path, tmp_path):
    binary = stock_llama_server()
    if binary is None:
        pytest.skip("stock llama-server is not built (scripts/build_llama_tools.sh)")
    config = RunnerConfig(ModelConfig(path=str(gemma_path), n_ctx=1024, n_seq_max=1, n_threads=2), pooling=pooling)
    server = make_server("127.0.0.1", 0, create_app(config), threaded=True)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    ours = httpx.Client(base_url=f"http://127.0.0.1:{server.server_port}", timeout=120)
    proc, theirs = _stock_server(binary, gemma_path, tmp_path / "llama-server.log", "--embedding",
                                 "--pooling", pooling)
    try:
        wait_until(lambda: ours.get("/health").status_code == 200, timeout_s=120, message="the runner to load")
        body = {"input": ["I believe the meaning of life is", "This is a test"]}
        a = ours.post("/v1/embeddings", json=body).json()
        b = theirs.post("/v1/embeddings", json=body).json()
    finally:
        ours.close()
        theirs.close()
        proc.stop()
        server.shutdown()
    assert a["usage"] == b["usage"]
    assert len(a["data"]) == len(b["data"]) == 2
    for x, y in zip(a["data"], b["data"]):
        # The same vector up to float noise: the two builds may batch the inputs into different matmul kernels
        # (llama.cpp's CPU path changes with the batch size), which moves single elements of a Q4 model's pooled
        # vector by ~3e-3. What retrieval uses is the direction. Last pooling reads one token's state, nothing
        # averaged: on an Intel Xeon VM (AVX-512 kernels, repack off on both sides) "This is a test" came out at
        # cosine 0.99889 with Hearth's cache layout and with llama-server's defaults alike (0.999+ on an AMD box).
        u, v = x["embedding"], y["embedding"]
        assert len(u) == len(v)
        cosine = sum(p * q for p, q in zip(u, v)) / math.sqrt(sum(p * p for p in u) * sum(q * q for q in v))
        assert cosine > (0.999 if pooling == "mean" else 0.998), f"{pooling} pooling: cosine {cosine:.5f} to stock llama-server's vector"
