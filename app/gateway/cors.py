"""Browser apps on other origins calling the API (CORS), as far as the admin's api_cors_origins allows.

The OpenAI, Ollama, Anthropic and Responses routes authenticate by bearer token only, so a page
the admin allowed may call them with a token of its own; the answer never carries
Access-Control-Allow-Credentials, so a browser neither sends the admin's login cookie with such a
call nor lets the page read an answer it got with one. The dashboard's routes get no CORS headers
at all: another site's page cannot read them. Empty (the default) allows no origin, and a
preflight from one that is not listed is answered 403 with the setting to change.
"""

from __future__ import annotations

from flask import Flask, Response, request
from werkzeug.exceptions import MisdirectedRequest

from app.gateway.context import services
from app.gateway.lan import allowed_host, misdirected, own_host_names
from app.gateway.pipeline import error_response
from app.protocols.openai import ApiError
from app.store.settings import cors_origins, host_names

# The blueprints whose routes are the API (app.gateway.api, .ollama, .vendors, .audio).
API_BLUEPRINTS = frozenset({"gateway", "ollama", "vendors", "audio"})
ALLOW_METHODS = "GET, POST, DELETE, HEAD, OPTIONS"
# What clients send besides the simple headers; a preflight's own list is echoed instead when it has one.
ALLOW_HEADERS = "Authorization, Content-Type, X-Api-Key, X-Hearth-Class, anthropic-version, OpenAI-Beta"
EXPOSE_HEADERS = "Retry-After, X-Hearth-Class, X-Hearth-Model, X-Hearth-Node, X-Hearth-Queue-Position"
MAX_AGE_S = 600


def allowed_origin(origin: str) -> str | None:
    """The Access-Control-Allow-Origin value for this origin, or None when the setting does not list it."""
    listed = cors_origins(services().settings.get("api_cors_origins"))
    if "*" in listed:
        return "*"
    return origin if origin.rstrip("/").lower() in listed else None


def _on_api() -> bool:
    return request.blueprint in API_BLUEPRINTS


def install_host_check(app: Flask) -> None:
    """Refuse (421) any request whose Host is not one of serve's own names or addresses (app.gateway.lan), before
    anything else: in the API's error shape on its routes, as a page on the dashboard's."""
    own_host_names()  # read the machine's names at start, not on a request

    @app.before_request
    def _check_host():
        host = request.host
        if allowed_host(host, own_host_names(), host_names(services().settings.get("allowed_hosts"))):
            return None
        if _on_api():
            raise ApiError(421, misdirected(host), code="misdirected_host", err_type="invalid_request_error")
        raise MisdirectedRequest(misdirected(host))


def install_cors(app: Flask) -> None:
    """Answer API preflights and mark API answers for the allowed origins."""

    @app.before_request
    def _preflight():
        origin = request.headers.get("Origin")
        if request.method != "OPTIONS" or not origin or not _on_api() \
                or "Access-Control-Request-Method" not in request.headers:
            return None
        allow = allowed_origin(origin)
        if allow is None:
            err = ApiError(403, f"web pages from {origin} may not call this API: an admin can allow the origin under "
                                "Settings → Network and access → API origins for browser apps (api_cors_origins)",
                           code="origin_not_allowed", err_type="permission_error")
            return error_response(err)
        resp = Response(status=204)
        resp.headers["Access-Control-Allow-Origin"] = allow
        resp.headers["Access-Control-Allow-Methods"] = ALLOW_METHODS
        resp.headers["Access-Control-Allow-Headers"] = request.headers.get("Access-Control-Request-Headers") or ALLOW_HEADERS
        resp.headers["Access-Control-Max-Age"] = str(MAX_AGE_S)
        resp.headers["Vary"] = "Origin"
        return resp

    @app.after_request
    def _mark(resp: Response) -> Response:
        origin = request.headers.get("Origin")
        if origin and _on_api() and "Access-Control-Allow-Origin" not in resp.headers:
            allow = allowed_origin(origin)
            if allow is not None:
                resp.headers["Access-Control-Allow-Origin"] = allow
                resp.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS
                resp.vary.add("Origin")
        return resp
