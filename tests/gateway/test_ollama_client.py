"""The official `ollama` Python client, unchanged, against a real `hearth serve` on the real Gemma GGUF."""

import shutil
import time

import httpx
import ollama
import pytest

from app.devtools.hub_server import HubServer, tiny_gguf
from app.devtools.serve_process import ServeProcess, prepare_data
from app.gateway.auth import PREFIX_CHARS
from app.gateway.tokens import set_token
from app.store.db import open_store
from tests.helpers import wait_until

DEFAULT = "gemma-3-270m-q4_k_m"
SHORT = {"num_predict": 4, "temperature": 0}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A loopback Hugging Face hub with one small GGUF, for pulls."""
    src = tmp_path_factory.mktemp("hub")
    server = HubServer({"tiny-Q4_K_M.gguf": tiny_gguf(src / "tiny.gguf")})
    yield server
    server.close()


@pytest.fixture(scope="module")
def oserve(tmp_path_factory, gemma_path, hub):
    """A serve of its own: keep_alive tests load and unload its models; 'gemma-b' is pinned by the admin;
    API tokens may pull from the loopback hub."""
    data = tmp_path_factory.mktemp("ollama-serve")
    models = tmp_path_factory.mktemp("ollama-models")
    # A copy, not a link: the catalog lists one file once, however many names it has.
    shutil.copyfile(gemma_path, models / "gemma-b.gguf")
    tokens = prepare_data(data, settings={"runner_ctx": 1024, "runner_parallel": 2, "runner_threads": 2,
                                          "api_manage_models": True, "hf_endpoint": hub.url},
                          tokens=[("alice", "chat", ["voice"]), ("kid", "voice", [])], policies={"gemma-b": "pinned"})
    # alice's token may manage models (api_manage_models is on); kid's is a family token, as every token is by default.
    engine, sessions = open_store(data)
    with sessions() as session:
        set_token(session, tokens["alice"][:PREFIX_CHARS], may_manage=True)
    engine.dispose()
    s = ServeProcess(data, models, gemma_path, data / "serve.log")
    s.tokens = tokens
    s.models = models
    yield s
    s.stop()


@pytest.fixture()
def client(oserve):
    c = ollama.Client(host=oserve.url, headers={"Authorization": f"Bearer {oserve.tokens['alice']}"})
    yield c
    c.close()


@pytest.fixture()
def family(oserve):
    """A client with a family token: no manage permission."""
    c = ollama.Client(host=oserve.url, headers={"Authorization": f"Bearer {oserve.tokens['kid']}"})
    yield c
    c.close()


def ps_names(client) -> dict:
    return {m.model: m for m in client.ps().models}


def test_version_is_open_and_the_rest_needs_a_token(oserve):
    assert httpx.get(oserve.url + "/api/version").json()["version"]
    with ollama.Client(host=oserve.url) as tokenless, pytest.raises(ollama.ResponseError) as e:
        tokenless.list()
    assert e.value.status_code == 401 and "token" in e.value.error


def test_list_names_models_with_their_tag(client):
    models = {m.model: m for m in client.list().models}
    assert f"{DEFAULT}:latest" in models and "gemma-b:latest" in models
    m = models[f"{DEFAULT}:latest"]
    assert m.size > 100 * 2**20 and m.details.format == "gguf" and m.details.family == "gemma3"
    assert m.details.quantization_level == "Q4_K_M" and len(m.digest) == 64


def test_show_reads_the_gguf(client):
    r = client.show(f"{DEFAULT}:latest")
    assert r.modelinfo["general.architecture"] == "gemma3"
    assert r.modelinfo["gemma3.context_length"] > 0
    assert r.modelinfo["tokenizer.ggml.tokens"] is None  # long arrays are not sent, as Ollama does
    assert "completion" in r.capabilities and "embedding" in r.capabilities
    assert "start_of_turn" in r.template and r.details.family == "gemma3"
    with pytest.raises(ollama.ResponseError) as e:
        client.show("nope")
    assert e.value.status_code == 404


def test_chat_whole_and_streamed(client):
    # The same cache state for both answers: a first ask leaves the prompt cached, so each answer below reuses all of
    # it but its last token (as llama-server's slot does). A cold prefill and a warm one round differently on some
    # CPUs (a one-token batch is not a slice of a prompt batch), which can tip a greedy near-tie.
    client.chat(model=DEFAULT, messages=[{"role": "user", "content": "Hi"}], options=SHORT, stream=False)
    r = client.chat(model=DEFAULT, messages=[{"role": "user", "content": "Hi"}], options=SHORT, stream=False)
    assert r.message.role == "assistant" and r.message.content
    assert r.done and r.done_reason == "length" and r.eval_count == 4 and r.prompt_eval_count > 0
    assert r.total_duration > 0 and r.model == DEFAULT
    parts = list(client.chat(model=f"{DEFAULT}:latest", messages=[{"role": "user", "content": "Hi"}], options=SHORT,
                             stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == 4
    assert "".join(p.message.content for p in parts) == r.message.content  # temperature 0: the same answer


def test_generate_whole_streamed_raw_and_system(client):
    r = client.generate(model=DEFAULT, prompt="The capital of France is", options=SHORT, raw=True)
    assert r.response and r.eval_count == 4 and r.done_reason == "length"
    parts = list(client.generate(model=DEFAULT, prompt="Hi", system="Answer in French.", options=SHORT, stream=True))
    assert parts[-1].done and "".join(p.response for p in parts)
    stop = client.generate(model=DEFAULT, prompt="Count: 1, 2, 3,", raw=True,
                           options={"num_predict": 20, "temperature": 0, "stop": [","]})
    assert "," not in stop.response and stop.done_reason == "stop"


def test_errors_in_ollama_shape(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope:latest", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 404 and "nope" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=DEFAULT, messages=[{"role": "user", "content": "Hi", "images": [b"\x89PNG"]}])
    assert e.value.status_code == 400 and "images" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=DEFAULT, messages=[{"role": "user", "content": "Hi"}], options={"temperature": 7})
    assert e.value.status_code == 400 and "temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="x", from_=DEFAULT)
    assert e.value.status_code == 501


def test_keep_alive_zero_unloads_a_duration_sets_the_ttl(client):
    client.generate(model=DEFAULT, prompt="Hi", options=SHORT, keep_alive="10m")
    m = ps_names(client)[f"{DEFAULT}:latest"]
    left_s = (m.expires_at.timestamp() - time.time())
    assert 500 < left_s <= 600
    client.generate(model=DEFAULT, prompt="Hi", options=SHORT, keep_alive=0)
    wait_until(lambda: f"{DEFAULT}:latest" not in ps_names(client), 30, "the default model was never unloaded")
    # An empty prompt only loads the model, here to stay (-1).
    r = client.generate(model=DEFAULT, keep_alive=-1)
    assert r.done and r.done_reason == "load"
    assert ps_names(client)[f"{DEFAULT}:latest"].expires_at.year > 2300
    r = client.generate(model=DEFAULT, keep_alive=0)
    assert r.done_reason == "unload" and f"{DEFAULT}:latest" not in ps_names(client)


def test_keep_alive_never_overrides_an_admins_pin(client):
    wait_until(lambda: "gemma-b:latest" in ps_names(client), 30, "gemma-b was never listed as loaded")  # pinned: loaded at start
    client.chat(model="gemma-b", messages=[{"role": "user", "content": "Hi"}], options=SHORT, keep_alive=0)
    assert ps_names(client)["gemma-b:latest"].expires_at.year > 2300
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="gemma-b", keep_alive=0)
    assert e.value.status_code == 409 and "pinned" in e.value.error
    assert "gemma-b:latest" in ps_names(client)


def add_two_numbers(a: int, b: int) -> int:
    """Add two numbers.

    Args:
      a: The first number
      b: The second number
    """
    return a + b


# Under Ollama's API there is no tool_choice, so the call is "auto" (a lazy grammar): Gemma 3 270M
# answers in prose (it repeats the tool instructions) instead of calling. The Ollama tool-call shapes
# themselves (arguments as objects both ways) are covered in test_ollama_shapes.py.
@pytest.mark.xfail(strict=False, reason="Gemma 3 270M does not choose to call a tool under tool_choice auto")
def test_tools_with_arguments_as_objects(client):
    messages = [{"role": "user", "content": "What is 3 plus 4? Use the tool."}]
    r = client.chat(model=DEFAULT, messages=messages, tools=[add_two_numbers], stream=False,
                    options={"num_predict": 64, "temperature": 0})
    assert r.message.tool_calls, r.message.content
    call = r.message.tool_calls[0]
    assert call.function.name == "add_two_numbers" and isinstance(call.function.arguments, dict)
    result = add_two_numbers(**call.function.arguments)
    messages += [r.message, {"role": "tool", "content": str(result), "tool_name": call.function.name}]
    again = client.chat(model=DEFAULT, messages=messages, tools=[add_two_numbers], options=SHORT, stream=False)
    assert again.done


def test_embed_many_and_the_older_single_prompt(client):
    r = client.embed(model=DEFAULT, input=["The cat sat on the mat.", "Quarterly revenue grew."])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 640 and r.prompt_eval_count > 4
    assert abs(sum(x * x for x in r.embeddings[0]) - 1) < 1e-4
    one = client.embed(model=f"{DEFAULT}:latest", input="The cat sat on the mat.")
    assert sum(a * b for a, b in zip(one.embeddings[0], r.embeddings[0])) > 0.999
    old = client.embeddings(model=DEFAULT, prompt="The cat sat on the mat.")
    assert len(old.embedding) == 640
    short = client.embed(model=DEFAULT, input="The cat", dimensions=64)
    assert len(short.embeddings[0]) == 64


def test_openai_client_embeddings_create(oserve):
    import base64

    import numpy as np
    import openai

    with openai.OpenAI(base_url=oserve.url + "/v1", api_key=oserve.tokens["alice"], max_retries=0) as c:
        r = c.embeddings.create(model=DEFAULT, input=["Hello there", "General Kenobi"])
        assert [d.index for d in r.data] == [0, 1] and len(r.data[0].embedding) == 640
        assert r.usage.prompt_tokens > 2
        raw = c.embeddings.create(model=DEFAULT, input="Hello there", encoding_format="base64")
        # Asked for explicitly, base64 comes back as sent: little-endian float32, the same vector.
        vec = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
        # Alone or batched with another input, the vector agrees to float noise.
        assert vec.shape == (640,) and float(vec @ np.array(r.data[0].embedding)) > 0.999
        with pytest.raises(openai.BadRequestError):
            c.embeddings.create(model=DEFAULT, input="Hi", dimensions=10_000)


def test_pull_copy_and_delete(client, oserve, hub):
    parts = list(client.pull("hf.co/owner/repo:Q4_K_M", stream=True))
    statuses = [p.status for p in parts]
    assert statuses[0] == "pulling manifest" and statuses[-3:] == ["verifying sha256 digest", "writing manifest",
                                                                    "success"]
    progress = [p for p in parts if p.total]
    assert progress[-1].completed == progress[-1].total == hub.files["tiny-Q4_K_M.gguf"].stat().st_size
    assert progress[-1].digest == "sha256:" + hub.sha256("tiny-Q4_K_M.gguf")
    assert (oserve.models / "tiny-Q4_K_M.gguf").exists()
    assert "tiny-Q4_K_M:latest" in {m.model for m in client.list().models}
    client.copy("tiny-Q4_K_M", "tiny:latest")
    assert "tiny:latest" in {m.model for m in client.list().models}
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("hf.co/owner/repo:Q8_0", stream=False)
    assert "no GGUF file of quantisation 'Q8_0'" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3.2")
    assert "Ollama registry" in e.value.error
    client.delete("tiny-Q4_K_M:latest")
    assert not (oserve.models / "tiny-Q4_K_M.gguf").exists()
    assert "tiny-Q4_K_M:latest" not in {m.model for m in client.list().models}
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(DEFAULT)
    assert e.value.status_code == 409


# -- a family token cannot pull, delete, alias or unload ----------------------------------------------


def _refused(call) -> str:
    with pytest.raises(ollama.ResponseError) as e:
        call()
    assert e.value.status_code == 403, e.value.error
    assert "lacks the manage permission" in e.value.error and "--manage" in e.value.error
    return e.value.error


def test_a_family_token_cannot_pull(family, oserve):
    assert "may not pull a model" in _refused(lambda: family.pull("hf.co/owner/repo:Q4_K_M", stream=False))
    assert not list(oserve.models.glob("tiny*"))


def test_a_family_token_cannot_delete(family, client):
    assert "may not delete a model" in _refused(lambda: family.delete("gemma-b"))
    assert "gemma-b:latest" in {m.model for m in client.list().models}


def test_a_family_token_cannot_alias(family, client):
    assert "may not copy a model" in _refused(lambda: family.copy(DEFAULT, "voice-model"))
    assert "voice-model:latest" not in {m.model for m in client.list().models}


def test_a_family_token_cannot_unload(family, client):
    client.generate(model=DEFAULT, prompt="Hi", options=SHORT, keep_alive="10m")
    assert "may not load or unload a model" in _refused(lambda: family.generate(model=DEFAULT, keep_alive=0))
    assert "may not load or unload a model" in _refused(
        lambda: family.chat(model=DEFAULT, messages=[], keep_alive=0))
    # Its keep_alive with a real prompt is answered, and the admin's keep-alive stays: the model stays resident.
    r = family.generate(model=DEFAULT, prompt="Hi", options=SHORT, keep_alive=0)
    assert r.done
    # Had its keep_alive 0 applied, ps would say the model expires now (and the expiry job would unload it).
    assert f"{DEFAULT}:latest" in ps_names(client)
    left_s = ps_names(client)[f"{DEFAULT}:latest"].expires_at.timestamp() - time.time()
    assert left_s > 60
