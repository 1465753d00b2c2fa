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

from flask import Blueprint, request

from app.gateway import bodies
from app.gateway.pipeline import authenticate, serve_generation
from app.protocols import anthropic, responses
from app.protocols.openai import ApiError, ChatBody

bp = Blueprint("vendors", __name__)


def _shape(err: ApiError) -> tuple[int, dict]:
    """Errors before the relay (token, class, queue) in the caller's vendor's shape."""
    return anthropic.error_body(err) if request.path == "/v1/messages" else bodies.openai_shape(err)


bodies.install(bp, _shape)


@bp.post("/v1/messages")
def messages():
    """Anthropic's Messages API through the household's classes."""
    # The token first: a client without one is answered before a byte of its body is read.
    principal = authenticate()
    # The prompt's size is not known here before the end: message_start says 0, message_delta the count.
    adapter = anthropic.MessagesAdapter(bodies.json_object(), input_tokens=0)
    return serve_generation(ChatBody, "/v1/chat/completions", adapter, principal=principal)


@bp.post("/v1/responses")
def create_response():
    """OpenAI's Responses API (stateless) through the household's classes."""
    principal = authenticate()
    return serve_generation(ChatBody, "/v1/chat/completions", responses.ResponsesAdapter(bodies.json_object()),
                            principal=principal)
