"""Other vendors' APIs on the runner, translated to and from its own OpenAI chat route.

Anthropic's Messages API (app.protocols.anthropic) and OpenAI's Responses API (app.protocols.responses)
are the same generation as /v1/chat/completions in other words, so they are served the way
llama-server serves them: the request is translated into a chat request, the runner's chat route
answers it in-process (the same WSGI call a client's request takes, so the engine, templates,
tool calls and grammars are the chat route's own), and its answer — JSON or an event stream — is
translated back. The coupling is the OpenAI wire format, not the server's internals.
/rerank (app.runner.rerank) is registered here too.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, ValidationError
from werkzeug.routing import Map, Rule
from werkzeug.wrappers import Request as HttpRequest
from werkzeug.wrappers import Response

from app.engine import tools as toolfmt
from app.engine.chat import ChatTemplateError, strip_leading_bos
from app.protocols.openai import ApiError, ChatBody, parse_body, too_large, validation_error

CHAT_PATH = "/v1/chat/completions"
# llama-server answers 500 with this message when a request carries an image and no vision
# projector is loaded; clients written against it (and its own tests) look for these words.
IMAGE_UNSUPPORTED = "image input is not supported by this runner: its model has no vision projector (mmproj)"


def image_unsupported() -> ApiError:
    """The error for an image in a request (500, as llama-server answers it)."""
    return ApiError(500, IMAGE_UNSUPPORTED, code="image_unsupported", err_type="server_error")


def read_json(req: HttpRequest) -> dict:
    """A request's JSON object body (a clear 400 for anything else)."""
    from werkzeug.exceptions import RequestEntityTooLarge

    try:
        raw = req.get_data(cache=False)
    except RequestEntityTooLarge:
        raise too_large()
    return parse_body(raw, _AnyObject)[1]


class _AnyObject(BaseModel):
    """Any JSON object: parse_body's checks (size, UTF-8, JSON, an object) without field validation."""

    model_config = ConfigDict(extra="allow")


def json_response(data, status: int = 200, headers: dict | None = None) -> Response:
    """A JSON response."""
    return Response(json.dumps(data, ensure_ascii=False), status=status, headers=headers, mimetype="application/json")


def sse(event: str, data: dict) -> bytes:
    """One server-sent event with its name (Anthropic's and OpenAI's Responses SDKs dispatch on it)."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


@dataclass
class Upstream:
    """The chat route's answer to an in-process request: status, and its body still unread."""

    status: int
    headers: dict[str, str]
    body: _Closing

    @property
    def retry_after(self) -> dict[str, str]:
        """The Retry-After header of a 503, to pass on (the other headers describe the old body)."""
        return {k: v for k, v in self.headers.items() if k.lower() == "retry-after"}

    def json(self) -> dict:
        """The whole body as JSON (a non-streamed answer or an error)."""
        try:
            return json.loads(b"".join(self.body))
        finally:
            self.close()

    def events(self) -> Iterator[dict]:
        """The `data:` payloads of a streamed answer, as they come; [DONE] ends it."""
        buf = b""
        try:
            for piece in self.body:
                buf += piece
                while b"\n\n" in buf:
                    block, buf = buf.split(b"\n\n", 1)
                    for line in block.split(b"\n"):
                        if not line.startswith(b"data: "):
                            continue
                        data = line[len(b"data: "):]
                        if data == b"[DONE]":
                            return
                        yield json.loads(data)
        finally:
            self.close()

    def close(self) -> None:
        """Close the body: a stream that is closed early cancels its generation."""
        self.body.close()


def call_chat(app, req: HttpRequest, chat: dict) -> Upstream:
    """Answer `chat` with the runner's chat route, in-process, on the client's connection."""
    raw = json.dumps(chat, ensure_ascii=False).encode()
    # The same environ but the body and path: the route sees the client's headers and socket, so
    # a client that goes away still cancels its generation.
    environ = {**req.environ, "PATH_INFO": CHAT_PATH, "REQUEST_METHOD": "POST", "QUERY_STRING": "",
               "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(raw)), "wsgi.input": io.BytesIO(raw)}
    environ.pop("werkzeug.request", None)
    started: list = []

    def start_response(line, headers, exc_info=None):
        started.append((int(line.split()[0]), dict(headers)))
        return lambda data: None

    body = _Closing(app(environ, start_response))  # start_response runs inside the call
    return Upstream(*started[0], body)


class _Closing:
    """An iterator over a WSGI body that keeps its close()."""

    def __init__(self, body):
        self._body = body
        self._it = iter(body)

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        return next(self._it)

    def close(self) -> None:
        """Close the WSGI body (PEP 3333: the server must, when the body has close())."""
        close = getattr(self._body, "close", None)
        if close is not None:
            close()


def loaded_state(app):
    """The runner's state once its model is loaded (the server's own 503/500 while it is not)."""
    app._ready()
    return app.state


def prompt_tokens(state, chat: dict) -> list[int]:
    """The prompt tokens the chat route would build for `chat` (the same validation and template)."""
    try:
        body = ChatBody.model_validate(chat)
    except ValidationError as exc:
        raise validation_error(exc)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    tools = body.tool_list
    fmt = state.tool_format
    messages = toolfmt.prepare_messages(messages, fmt, tools, body.choice, body.parallel_tool_calls)
    try:
        text = state.template.render(messages, add_generation_prompt=True,
                                     tools=tools if tools and fmt != toolfmt.GENERIC else None)
    except ChatTemplateError as exc:
        raise ApiError(400, f"'messages': {exc}", param="messages", code="chat_template")
    text, _ = strip_leading_bos(text, state.template.bos_token)
    return state.model.tokenize(text, add_special=True, parse_special=True)


def install(app, url_map: Map) -> None:
    """Add the translated APIs' routes to a runner app's map (their endpoints are the handlers themselves)."""
    from app.protocols import anthropic, responses
    from app.runner import rerank

    routes: dict[str, Callable] = {
        "/v1/messages": anthropic.on_messages,
        "/v1/messages/count_tokens": anthropic.on_count_tokens,
        "/v1/responses": responses.on_responses,
        "/responses": responses.on_responses,
        "/v1/responses/input_tokens": responses.on_input_tokens,
        "/responses/input_tokens": responses.on_input_tokens,
    }
    routes.update({path: rerank.on_rerank for path in rerank.PATHS})
    for path, handler in routes.items():
        url_map.add(Rule(path, endpoint=functools.partial(handler, app), methods=["POST"]))
