"""POST /rerank (also /v1/rerank, /reranking, /v1/reranking), when the runner is in reranking mode.

llama-server's endpoint, in both of its request shapes: Jina's (`documents`, answered with
`results` of {index, relevance_score} and `usage`) and Hugging Face TEI's (`texts`, answered with
a bare list of {index, score}, plus `text` with `return_text`). Results are sorted by score, best
first, cut to `top_n`. Each (query, document) pair is laid out as llama-server lays it out (the
GGUF's rerank prompt, else BOS query EOS SEP document EOS) and scored by the model with rank
pooling on the runner's loaded weights (app.engine.embeddings). A real reranker GGUF (a BERT or
Qwen3 cross-encoder with a classification head) gives relevance scores; a generative model has
no such head, and its "score" is then what llama.cpp computes for it (the first value of the
last token's hidden state), the same number llama-server reports.
"""

from __future__ import annotations

import threading
import weakref

from werkzeug.wrappers import Request as HttpRequest
from werkzeug.wrappers import Response

from app.protocols.openai import ApiError
from app.runner.state import RunnerState
from app.runner.transport import json_response, read_object

PATHS = ("/rerank", "/v1/rerank", "/reranking", "/v1/reranking")
MAX_DOCUMENTS = 1024

_scorers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_scorers_lock = threading.Lock()


def _scorer(state):
    """The runner's rank-pooling context, made on first use."""
    from app.engine.embeddings import EmbeddingContext

    with _scorers_lock:
        scorer = _scorers.get(state)
        if scorer is None:
            scorer = _scorers[state] = EmbeddingContext(state.model, state.config.model.n_threads, pooling="rank")
        return scorer


def _documents(body: dict) -> list[str]:
    docs = body.get("documents", body.get("texts"))
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise ApiError(400, '"documents" must be a non-empty string array', param="documents")
    if len(docs) > MAX_DOCUMENTS:
        raise ApiError(400, f'"documents": at most {MAX_DOCUMENTS} per request', param="documents")
    return docs


def on_rerank(state: RunnerState, req: HttpRequest) -> Response:
    """POST /rerank: the documents scored against the query, best first."""
    if not state.config.reranking:
        raise ApiError(501, "This server does not support reranking. Start it with `--reranking`",
                       code="not_supported", err_type="not_supported_error")
    body = read_object(req)
    query = body.get("query")
    if not isinstance(query, str):
        raise ApiError(400, '"query" must be provided as a string', param="query")
    docs = _documents(body)
    top_n = body.get("top_n", len(docs))
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise ApiError(400, '"top_n" must be a non-negative integer', param="top_n")
    tei = "texts" in body
    state.ready()
    from app.engine.embeddings import InputTooLong, rerank_tokens

    inputs = [rerank_tokens(state.model, query, d) for d in docs]
    try:
        # A pair longer than the scoring context is refused, not cut: its score would be of
        # another text.
        scored = _scorer(state).embed(inputs, truncate=False)
    except InputTooLong as exc:
        raise ApiError(400, str(exc), param="documents", code="context_length_exceeded")
    score_key = "score" if tei else "relevance_score"
    results = [{"index": i, score_key: float(vec[0])} for i, vec in enumerate(scored.vectors)]
    if tei and body.get("return_text"):
        for r in results:
            r["text"] = docs[r["index"]]
    results.sort(key=lambda r: r[score_key], reverse=True)
    results = results[:top_n]
    if tei:
        return json_response(results)
    return json_response({"model": body.get("model") or state.config.model_name, "object": "list",
                          "usage": {"prompt_tokens": scored.num_tokens, "total_tokens": scored.num_tokens},
                          "results": results})
