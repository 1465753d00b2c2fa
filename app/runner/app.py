"""The runner's HTTP surface (llama-server's protocol) as a plain WSGI app on werkzeug.

The endpoints are the ROUTES table below, with and without /v1 as llama-server serves them:
OpenAI's chat and text completions, llama-server's native /completion, /infill, /apply-template,
/tokenize, /detokenize, /props, /slots, /metrics, /health, /embeddings, /rerank, and Anthropic's
Messages and OpenAI's Responses APIs. Around every route, as llama-server: CORS headers and
OPTIONS preflight, the API key (--api-key; /health stays public), a JSON 404, and one error
wrapper (llama-server's ex_wrapper) that turns whatever a handler raises into the error answer,
in OpenAI's shape with llama-server's `type` unless the route's API has its own. No Flask here.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import NamedTuple

from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound
from werkzeug.routing import Map, Rule
from werkzeug.wrappers import Request as HttpRequest
from werkzeug.wrappers import Response

from app.protocols import anthropic
from app.protocols.openai import ApiError, body_limit
from app.runner import apis, completions, embedding, hold, info, rerank, tokens, transcriptions
from app.runner.config import RunnerConfig
from app.runner.state import Backend, RunnerState, llama_backend
from app.runner.transport import ErrorShape, error_response, json_response, openai_error

log = logging.getLogger(__name__)

# Reachable without the API key, as in llama-server (a supervisor polls them).
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
# --cors-origins none: no Access-Control header and no preflight answer, so browsers refuse every page.
CORS_NONE = "none"

Handler = Callable[[RunnerState, HttpRequest], Response]


class Route(NamedTuple):
    """A path, its handler, its methods, and the shape its errors take."""

    path: str
    handler: Handler
    methods: tuple[str, ...] = ("POST",)
    errors: ErrorShape = openai_error


GET = ("GET",)
ROUTES: list[Route] = [
    *(Route(p, info.on_health, GET) for p in ("/health", "/v1/health")),
    Route("/slots", info.on_slots, GET),
    Route("/metrics", info.on_metrics, GET),
    Route("/props", info.on_props, GET),
    *(Route(p, info.on_models, GET) for p in ("/models", "/v1/models")),
    Route("/tokenize", tokens.on_tokenize),
    Route("/detokenize", tokens.on_detokenize),
    Route("/apply-template", tokens.on_apply_template),
    *(Route(p, completions.on_native_completion) for p in ("/completion", "/completions")),
    Route("/v1/completions", completions.on_completions),
    Route("/infill", completions.on_infill),
    *(Route(p, completions.on_chat) for p in ("/chat/completions", "/v1/chat/completions")),
    *(Route(p, tokens.on_chat_input_tokens)
      for p in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens")),
    *(Route(p, embedding.on_embeddings) for p in ("/embedding", "/embeddings", "/v1/embeddings")),
    *(Route(p, rerank.on_rerank) for p in rerank.PATHS),
    Route("/v1/messages", apis.on_messages, errors=anthropic.error_body),
    Route("/v1/messages/count_tokens", apis.on_count_tokens, errors=anthropic.error_body),
    *(Route(p, apis.on_responses) for p in ("/v1/responses", "/responses")),
    *(Route(p, apis.on_input_tokens) for p in ("/v1/responses/input_tokens", "/responses/input_tokens")),
    *(Route(p, transcriptions.on_transcriptions) for p in transcriptions.PATHS),
    Route("/hearth/hold", hold.on_hold),
]


def not_found() -> Response:
    """llama-server's answer to a path it does not serve."""
    return json_response({"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}, 404)


def origin_is_localhost(origin: str) -> bool:
    """Whether a browser Origin is a loopback one (http(s)://localhost, 127.0.0.1 or [::1], any port)."""
    scheme, sep, rest = origin.partition("://")
    if not sep or scheme not in ("http", "https"):
        return False
    host = rest.split("/", 1)[0]
    if host.startswith("[::1]"):
        return host in ("[::1]",) or host.startswith("[::1]:")
    name, _, port = host.partition(":")
    return name in ("localhost", "127.0.0.1") and (port == "" or port.isdigit())


class RunnerApp:
    """WSGI callable for one runner."""

    def __init__(self, state: RunnerState):
        self.state = state
        self.url_map = Map([Rule(r.path, endpoint=r.path, methods=list(r.methods)) for r in ROUTES])
        self.routes = {r.path: r for r in ROUTES}

    def __call__(self, environ, start_response):
        req = HttpRequest(environ)
        req.max_content_length = body_limit(req.path)
        cors = self.state.config.cors_origins != CORS_NONE
        if req.method == "OPTIONS" and cors:
            # A browser's preflight carries no credentials: answered before the key check, as llama-server.
            resp = Response("", 200, mimetype="text/html")
            resp.headers["Access-Control-Allow-Credentials"] = "true"
            resp.headers["Access-Control-Allow-Methods"] = CORS_METHODS
            resp.headers["Access-Control-Allow-Headers"] = "*"
        else:
            resp = self._dispatch(req)
        if cors:
            self._cors(req, resp)
        return resp(environ, start_response)

    def _dispatch(self, req: HttpRequest) -> Response:
        """The one error wrapper: a route's answer, or what it raised as an error answer."""
        shape = openai_error  # the key check and routing answer in OpenAI's shape, as llama-server's
        try:
            if req.path not in PUBLIC_PATHS:
                self._check_key(req)
            path, _ = self.url_map.bind_to_environ(req.environ).match()
            route = self.routes[path]
            shape = route.errors
            return route.handler(self.state, req)
        except ApiError as err:
            return error_response(err, shape)
        except NotFound:
            return not_found()
        except MethodNotAllowed as exc:
            return error_response(ApiError(405, f"{req.method} is not allowed on {req.path}", code="method_not_allowed",
                                           headers={"Allow": ", ".join(exc.valid_methods or ())}))
        except HTTPException as exc:
            return error_response(ApiError(exc.code or 500, exc.description or exc.name, err_type="invalid_request_error"))
        except Exception as exc:  # one bad request must never take the runner down
            log.exception("unhandled error on %s", req.path)
            # The exception's text may name files and internals: the log has it, the caller a pointer there.
            return error_response(ApiError(500, f"internal error ({type(exc).__name__}); the runner's log has the "
                                                "details", err_type="server_error"))

    def _check_key(self, req: HttpRequest) -> None:
        keys = self.state.config.api_keys
        if not keys:
            return
        given = req.headers.get("Authorization") or req.headers.get("X-Api-Key") or ""
        if given.startswith("Bearer "):
            given = given[len("Bearer "):]
        if not given:
            raise ApiError(401, "Invalid API Key: this runner requires its key as 'Authorization: Bearer <key>' or "
                                "X-Api-Key (a runner started by `hearth serve` is called through serve's API, "
                                "with a Hearth token)", code="invalid_api_key", err_type="authentication_error")
        # Every key is compared, so the time taken says nothing about which one nearly matched.
        if not sum(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
            raise ApiError(401, "Invalid API Key", code="invalid_api_key", err_type="authentication_error")

    def _cors(self, req: HttpRequest, resp: Response) -> None:
        origins = self.state.config.cors_origins
        origin = req.headers.get("Origin", "")
        if origins == "*":
            # llama-server's default: any origin, with credentials, so the Origin is echoed back.
            resp.headers["Access-Control-Allow-Origin"] = origin
        elif origins == "localhost":
            if origin and origin_is_localhost(origin):
                resp.headers["Access-Control-Allow-Origin"] = origin
        else:
            resp.headers["Access-Control-Allow-Origin"] = origins


def create_app(config: RunnerConfig, load: bool = True, backend: Backend | None = None) -> RunnerApp:
    """The WSGI app for one runner; starts loading the model (llama.cpp's, unless a backend is given) in the background."""
    state = RunnerState(config, backend or llama_backend)
    if load:
        state.start_loading()
    return RunnerApp(state)
