"""/rerank's mode check and request validation (no model needed; scoring is in tests/e2e)."""

import pytest
from werkzeug.test import Client

from app.engine.model_config import ModelConfig
from app.runner.app import create_app
from app.runner.config import RunnerConfig


def client(reranking: bool) -> Client:
    return Client(create_app(RunnerConfig(ModelConfig(path="/nowhere/model.gguf"), reranking=reranking), load=False))


def test_a_runner_not_in_reranking_mode_says_how_to_start_one():
    r = client(False).post("/rerank", json={"query": "q", "documents": ["a"]})
    assert r.status_code == 501
    assert r.json["error"]["type"] == "not_supported_error" and "--reranking" in r.json["error"]["message"]


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/reranking", "/v1/reranking"])
@pytest.mark.parametrize("documents", [[], None, 123, [1, 2, 3]])
def test_documents_must_be_a_non_empty_list_of_strings(path, documents):
    r = client(True).post(path, json={"query": "Machine learning is", "documents": documents})
    assert r.status_code == 400 and r.json["error"]["param"] == "documents"


def test_query_and_top_n_are_checked():
    c = client(True)
    assert c.post("/rerank", json={"documents": ["a"]}).json["error"]["param"] == "query"
    assert c.post("/rerank", json={"query": "q", "texts": ["a"], "top_n": -1}).json["error"]["param"] == "top_n"
    # Valid, so it gets as far as the model, which is still loading.
    assert c.post("/rerank", json={"query": "q", "texts": ["a"]}).status_code == 503
