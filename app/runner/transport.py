"""The runner's HTTP plumbing: JSON bodies in, JSON and event-stream answers out (werkzeug, no Flask)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from pydantic import BaseModel
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.wrappers import Request as HttpRequest
from werkzeug.wrappers import Response

from app.protocols.body import load_object
from app.protocols.openai import ApiError, body_limit, parse_body, too_large

# An error as an API answers it: HTTP status and body (OpenAI's shape unless a route names another).
ErrorShape = Callable[[ApiError], tuple[int, dict]]


def json_response(data, status: int = 200, headers: dict | None = None) -> Response:
    """A JSON answer."""
    return Response(json.dumps(data, ensure_ascii=False), status=status, headers=headers, mimetype="application/json")


def openai_error(err: ApiError) -> tuple[int, dict]:
    """An error in OpenAI's shape with llama-server's `type`."""
    return err.status, err.body()


def error_response(err: ApiError, shape: ErrorShape = openai_error) -> Response:
    """An error as a JSON answer in the route's shape; its headers (Retry-After, Allow) kept."""
    status, body = shape(err)
    return json_response(body, status, err.headers)


def event_stream(pieces: Iterable[bytes], mimetype: str = "text/event-stream") -> Response:
    """A streamed answer, unbuffered by proxies."""
    return Response(pieces, mimetype=mimetype, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def read_body(req: HttpRequest, schema: type[BaseModel]):
    """A request's body validated by schema (a clear 400 or 413 for anything else)."""
    try:
        raw = req.get_data(cache=False)
    except RequestEntityTooLarge:
        raise too_large(body_limit(req.path))
    return parse_body(raw, schema, body_limit(req.path))[0]


def read_object(req: HttpRequest) -> dict:
    """A request's JSON object body, unvalidated (other APIs' bodies, translated before they are checked)."""
    limit = body_limit(req.path)
    try:
        raw = req.get_data(cache=False)
    except RequestEntityTooLarge:
        raise too_large(limit)
    if len(raw) > limit:
        raise too_large(limit)
    return load_object(raw)
