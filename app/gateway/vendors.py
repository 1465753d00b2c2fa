"""Anthropic's Messages API and OpenAI's Responses API on the gateway, through the household's classes.

Each is relayed like /v1/chat/completions (app.gateway.pipeline: token, class, admission, route,
record) through its adapter (app.protocols.anthropic's MessagesAdapter, app.protocols.responses'
ResponsesAdapter): the request becomes a chat request, the chat route of whichever runner serves
the model answers it — hearth runner, stock llama-server or a remote node alike — and the answer is
translated back. The token is a bearer token as on /v1; Anthropic clients send it with
ANTHROPIC_AUTH_TOKEN (or as x-api-key, which the gateway does not read). The model is a catalog
name, as on /v1.
"""

from __future__ import annotations

import json

from flask import Blueprint, Response, request
from werkzeug.exceptions import RequestEntityTooLarge

from app.gateway.pipeline import body_over_limit, error_response, limit_body, serve_generation
from app.protocols import anthropic, responses
from app.protocols.openai import ApiError, ChatBody

bp = Blueprint("vendors", __name__)


@bp.errorhandler(ApiError)
def _api_error(err: ApiError):
    """Errors before the relay (token, class, queue) in the caller's vendor's shape."""
    if request.path == "/v1/messages":
        status, body = anthropic.error_body(err)
        return Response(json.dumps(body), status=status, headers=err.headers, mimetype="application/json")
    return error_response(err)


bp.before_request(limit_body)
bp.register_error_handler(RequestEntityTooLarge, lambda exc: _api_error(body_over_limit(exc)))


def _body() -> dict:
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


@bp.post("/v1/messages")
def messages():
    """Anthropic's Messages API through the household's classes."""
    # The prompt's size is not known here before the end: message_start says 0, message_delta the count.
    return serve_generation(ChatBody, "/v1/chat/completions", anthropic.MessagesAdapter(_body(), input_tokens=0))


@bp.post("/v1/responses")
def create_response():
    """OpenAI's Responses API (stateless) through the household's classes."""
    return serve_generation(ChatBody, "/v1/chat/completions", responses.ResponsesAdapter(_body()))
