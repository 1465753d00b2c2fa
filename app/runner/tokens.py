"""The routes about prompts, not generation: /tokenize, /detokenize, /apply-template, chat input_tokens."""

from __future__ import annotations

from werkzeug.wrappers import Request as HttpRequest
from werkzeug.wrappers import Response

from app.protocols.openai import ApiError, ApplyTemplateBody, ChatBody, DetokenizeBody, TokenizeBody
from app.runner.prompts import chat_prompt
from app.runner.state import RunnerState
from app.runner.transport import json_response, read_body


def on_tokenize(state: RunnerState, req: HttpRequest) -> Response:
    """POST /tokenize: ids, or ids with their pieces."""
    body = read_body(req, TokenizeBody)
    state.ready()
    model = state.model
    tokens = model.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special)
    if not body.with_pieces:
        return json_response({"tokens": tokens})
    pieces = []
    for t in tokens:
        raw = model.token_bytes(t)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)  # part of a character: its bytes, as llama-server sends them
        pieces.append({"id": t, "piece": piece})
    return json_response({"tokens": pieces})


def on_detokenize(state: RunnerState, req: HttpRequest) -> Response:
    """POST /detokenize: ids back to text."""
    body = read_body(req, DetokenizeBody)
    state.ready()
    model = state.model
    bad = next((t for t in body.tokens if t >= model.n_vocab), None)
    if bad is not None:
        raise ApiError(400, f"'tokens': token id {bad} is outside the vocabulary (0..{model.n_vocab - 1})",
                       param="tokens")
    raw = b"".join(model.token_bytes(t) for t in body.tokens)
    return json_response({"content": raw.decode("utf-8", "replace")})


def on_apply_template(state: RunnerState, req: HttpRequest) -> Response:
    """POST /apply-template: the prompt text the chat route would run (llama-server's: its BOS text stripped)."""
    body = read_body(req, ApplyTemplateBody)
    state.ready()
    return json_response({"prompt": chat_prompt(state, body).text})


def on_chat_input_tokens(state: RunnerState, req: HttpRequest) -> Response:
    """POST /v1/chat/completions/input_tokens: the size of the prompt the chat route would run."""
    body = read_body(req, ChatBody)
    state.ready()
    return json_response({"input_tokens": len(chat_prompt(state, body).tokens)})
