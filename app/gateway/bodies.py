"""What every API blueprint of the gateway shares (OpenAI's /v1, Ollama's /api, the vendors' routes): one body
limit checked before a route runs, one body reader (app.protocols.body), and one error answer in the
blueprint's API shape for an ApiError, a body over its limit, and anything that went wrong unexpectedly (the
caller gets a request id to quote; the traceback goes to serve's log only)."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable

from flask import Blueprint, Response, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from app.gateway.pipeline import body_over_limit, limit_body
from app.protocols.body import load_object
from app.protocols.errors import ApiError

log = logging.getLogger(__name__)

# An error as an API answers it: HTTP status and body.
ErrorShape = Callable[[ApiError], tuple[int, dict]]


def openai_shape(err: ApiError) -> tuple[int, dict]:
    """An ApiError in OpenAI's shape."""
    return err.status, err.body()


def error_answer(err: ApiError, shape: ErrorShape) -> Response:
    """An ApiError as a JSON answer in shape, its headers (Retry-After, WWW-Authenticate) kept."""
    status, body = shape(err)
    return Response(json.dumps(body), status=status, headers=err.headers, mimetype="application/json")


def unexpected(exc: Exception) -> ApiError:
    """A 500 for an exception no route expected: logged whole for the admin, an id for the caller to quote."""
    ref = secrets.token_hex(4)
    log.exception("%s %s failed unexpectedly (error id %s)", request.method, request.path, ref)
    return ApiError(500, f"the gateway failed to answer this request (error id {ref}; the admin finds it in "
                         "serve's log)", err_type="server_error", code="internal_error")


def http_error(exc: HTTPException) -> ApiError:
    """A werkzeug HTTP error (a malformed form, a method a route lacks) as an ApiError of its status."""
    return ApiError(exc.code or 400, exc.description or exc.name, code=exc.name.lower().replace(" ", "_"),
                    headers=dict(exc.get_headers()) if exc.code == 405 else None)


def install(bp: Blueprint, shape: ErrorShape) -> None:
    """Give bp the body limit (checked before the route runs) and every error answered in shape."""
    bp.before_request(limit_body)
    bp.register_error_handler(ApiError, lambda err: error_answer(err, shape))
    bp.register_error_handler(RequestEntityTooLarge, lambda exc: error_answer(body_over_limit(exc), shape))
    bp.register_error_handler(HTTPException, lambda exc: error_answer(http_error(exc), shape))
    bp.register_error_handler(Exception, lambda exc: error_answer(unexpected(exc), shape))


def json_object(empty_is_object: bool = False) -> dict:
    """The request's JSON object, read once (app.protocols.body's limits); a 400 otherwise."""
    return load_object(request.get_data(cache=True), empty_is_object)
