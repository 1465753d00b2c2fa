"""Anthropic's Messages API and OpenAI's Responses API on the gateway, through the household's classes.

Each is relayed like /v1/chat/completions (app.gateway.api's _serve: token, class, admission,
route, record), with a shape as the Ollama routes have one: the request is translated into a chat
request by the runner's own translators (app.protocols.anthropic, app.protocols.responses), the chat
route of whichever runner serves the model answers it — hearth runner, stock llama-server or a
remote node alike — and the answer is translated back. The token is a bearer token as on /v1;
Anthropic clients send it with ANTHROPIC_AUTH_TOKEN (or as x-api-key, which the gateway does not
read). The model is a catalog name, as on /v1.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

from flask import Blueprint, request
from pydantic import ValidationError

from app.gateway.api import _error_response, _serve
from app.protocols import anthropic, responses
from app.protocols.openai import ApiError, ChatBody, validation_error

bp = Blueprint("vendors", __name__)


def _events(chunks: Iterator[bytes]) -> Iterator[dict]:
    """The `data:` payloads of the runner's chat stream."""
    tail = b""
    for chunk in chunks:
        tail += chunk
        *blocks, tail = tail.split(b"\n\n")
        for block in blocks:
            data = block.partition(b"data: ")[2].strip()
            if data and data != b"[DONE]":
                yield json.loads(data)


class _Shape:
    """A vendor's request on the gateway's path: read as a chat request, answered in the vendor's shape."""

    stream_mimetype = "text/event-stream"

    def __init__(self, body: dict):
        self.body = body

    def to_chat(self) -> dict:
        """The vendor body as a chat body."""
        raise NotImplementedError

    def parse(self, schema):
        """The translated body validated as /v1 validates its own (the gateway's _serve calls this)."""
        chat = self.to_chat()
        chat["model"] = self.body.get("model")
        try:
            return schema.model_validate(chat), chat
        except ValidationError as exc:
            raise validation_error(exc)


class MessagesShape(_Shape):
    """POST /v1/messages."""

    def __init__(self, body: dict):
        super().__init__(body)
        self.msg_id = "msg_" + uuid.uuid4().hex[:24]

    def to_chat(self) -> dict:
        """Anthropic's body as a chat body."""
        return anthropic.to_chat(self.body)

    def complete(self, status: int, content: bytes) -> bytes:
        """The runner's whole answer (or error) as Anthropic's."""
        payload = json.loads(content)
        if status != 200:
            message = (payload.get("error") or {}).get("message") or "request failed"
            return anthropic.error_response(ApiError(status, message)).get_data()
        return json.dumps(anthropic.to_message(payload, self.msg_id), ensure_ascii=False).encode()

    def stream(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """The runner's chat stream as Anthropic's events."""
        # The prompt's size is not known here before the end: message_start says 0, message_delta the count.
        translate = anthropic.MessageStream(self.msg_id, self.body.get("model"), input_tokens=0)
        for payload in _events(chunks):
            yield from translate.feed(payload)


class ResponsesShape(_Shape):
    """POST /v1/responses."""

    def __init__(self, body: dict):
        super().__init__(body)
        self.resp_id = "resp_" + uuid.uuid4().hex[:24]

    def to_chat(self) -> dict:
        """The Responses body as a chat body."""
        return responses.to_chat(self.body)

    def complete(self, status: int, content: bytes) -> bytes:
        """The runner's whole answer as a `response` (errors keep OpenAI's shape, as on /v1)."""
        if status != 200:
            return content
        return json.dumps(responses.to_response(json.loads(content), self.body, self.resp_id),
                          ensure_ascii=False).encode()

    def stream(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """The runner's chat stream as the Responses API's events."""
        translate = responses.ResponseStream(self.resp_id, self.body, self.body.get("model"))
        yield from translate.start()
        for payload in _events(chunks):
            yield from translate.feed(payload)


@bp.errorhandler(ApiError)
def _api_error(err: ApiError):
    """Errors before the relay (token, class, queue) in the caller's vendor's shape."""
    if request.path == "/v1/messages":
        return anthropic.error_response(err)
    return _error_response(err)


def _body() -> dict:
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


@bp.post("/v1/messages")
def messages():
    """Anthropic's Messages API through the household's classes."""
    return _serve(ChatBody, "/v1/chat/completions", MessagesShape(_body()))


@bp.post("/v1/responses")
def create_response():
    """OpenAI's Responses API (stateless) through the household's classes."""
    return _serve(ChatBody, "/v1/chat/completions", ResponsesShape(_body()))
