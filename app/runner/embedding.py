"""POST /v1/embeddings (also /embedding, /embeddings): vectors of texts or token ids, pooled as the runner was started."""

from __future__ import annotations

import base64
import time

from werkzeug.wrappers import Request as HttpRequest
from werkzeug.wrappers import Response

from app.protocols.openai import ApiError, EmbeddingBody
from app.runner.state import RunnerState
from app.runner.transport import json_response, read_body


def _inputs(model, body: EmbeddingBody) -> list[list[int]]:
    """Each input as tokens (text tokenized with BOS; ids checked against the vocabulary)."""
    inputs = []
    for i, item in enumerate(body.inputs()):
        if isinstance(item, str):
            inputs.append(model.tokenize(item, add_special=True, parse_special=False))
            continue
        bad = next((t for t in item if t >= model.n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"'input.{i}': token id {bad} is outside the vocabulary (0..{model.n_vocab - 1})",
                           param="input")
        inputs.append(item)
    return inputs


def on_embeddings(state: RunnerState, req: HttpRequest) -> Response:
    """The embeddings of the inputs, in OpenAI's shape."""
    body = read_body(req, EmbeddingBody)
    if state.config.pooling == "none":
        # One vector per token has no OpenAI shape; llama-server refuses it the same way.
        raise ApiError(400, "this runner was started with --pooling none (a vector per token), which has no "
                            "embeddings answer here: start it with --pooling mean, cls or last",
                       param="input", code="pooling_not_supported")
    state.ready()
    inputs = _inputs(state.model, body)
    embedder = state.embedder()
    if body.dimensions is not None and body.dimensions > embedder.n_embd:
        raise ApiError(400, f"'dimensions': {body.dimensions} is more than the model's {embedder.n_embd}",
                       param="dimensions")
    from app.engine.embeddings import InputTooLong, normalise

    t0 = time.monotonic()
    try:
        result = embedder.embed(inputs, truncate=body.truncate)
    except InputTooLong as exc:
        raise ApiError(400, str(exc), param="input", code="context_length_exceeded")
    data = []
    for i, vec in enumerate(result.vectors):
        if body.dimensions is not None:
            # Shortened as Matryoshka-trained models mean it: the leading dimensions, renormalised.
            vec = normalise(vec[: body.dimensions])
        if body.encoding_format == "base64":
            value = base64.b64encode(vec.astype("<f4").tobytes()).decode()
        else:
            value = vec.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return json_response({
        "object": "list", "data": data, "model": state.config.model_name,
        "usage": {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens},
        "timings": {"total_ms": (time.monotonic() - t0) * 1000, "num_decodes": result.num_decodes,
                    "pooling": embedder.pooling},
    })
