"""The OpenAI-compatible gateway: token → member → class → admission → model → runner → relay."""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from datetime import UTC, datetime

from flask import Blueprint, Response, request, stream_with_context
from pydantic import BaseModel

from app.gateway import relay
from app.gateway.auth import Principal, bearer_token
from app.gateway.context import services
from app.gateway.exchange import CLIENT_STALLED, STALL_SHARE, Exchange
from app.gateway.headers import header_value
from app.protocols.openai import (
    FIM_CLASS,
    MAX_BODY_BYTES,
    ApiError,
    ChatBody,
    CompletionBody,
    EmbeddingBody,
    InfillBody,
    parse_body,
    too_large,
)
from app.sockets import client_gone

log = logging.getLogger(__name__)

bp = Blueprint("gateway", __name__)
LAN_MEMBER = "lan"
CLIENT_CLOSED = 499  # logged for a request whose client left before it was answered (nginx's code)  # who tokenless requests are recorded as when the API is open to the LAN


def _error_response(err: ApiError) -> Response:
    return Response(json.dumps(err.body()), status=err.status, headers=err.headers, mimetype="application/json")


@bp.errorhandler(ApiError)
def _api_error(err: ApiError):
    return _error_response(err)


@bp.get("/metrics")
def metrics():
    """Prometheus text: per-class requests, tokens, TTFT/TPOT/queue histograms, residency gauges."""
    return Response(services().metrics.render(), mimetype="text/plain; version=0.0.4")


@bp.get("/openapi.json")
def openapi():
    """The gateway's OpenAPI description, generated from the request models."""
    from app.gateway.openapi import openapi_document

    return openapi_document()


@bp.get("/healthz")
def healthz():
    """Cheap liveness for container health checks: no model, no database query."""
    progress = services().catalog.default_model_progress()
    if progress is None:
        return {"status": "ok"}
    # Up and answering (so a container is healthy), but requests for the default model get 503 meanwhile.
    state = "failed" if progress["error"] else progress["phase"]
    return {"status": "ok", "default_model": {"state": state, "percent": progress["percent"],
                                              "error": progress["error"]}}


def _from_lan(addr: str | None) -> bool:
    try:
        ip = ipaddress.ip_address(addr or "")
    except ValueError:
        return False
    return ip.is_private or ip.is_loopback


def _authenticate() -> Principal:
    token = bearer_token(request.headers.get("Authorization"))
    settings = services().settings
    if token is None and request.headers.get("Authorization") is None and settings.get("api_open_on_lan") \
            and _from_lan(request.remote_addr):
        # Opened explicitly by the admin: tokenless LAN clients share one member and class.
        return Principal(token_id=None, member=LAN_MEMBER, default_class=str(settings.get("api_open_class")),
                         allowed_classes=())
    if token is None:
        raise ApiError(401, "missing API token: send 'Authorization: Bearer <token>' (create one with "
                            "`hearth token create --member NAME --class chat`)", code="missing_token",
                       err_type="authentication_error")
    principal = services().tokens.lookup(token)
    if principal is None:
        raise ApiError(401, "invalid or revoked API token", code="invalid_token", err_type="authentication_error")
    return principal


def _parse(schema: type[BaseModel]):
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise too_large()
    return parse_body(request.get_data(cache=False), schema)


def _choose_class(principal: Principal, body_class: str | None, fim: bool = False):
    wanted = request.headers.get("X-Hearth-Class") or body_class
    if wanted is None and fim and FIM_CLASS in services().classes.names() and principal.may_use(FIM_CLASS):
        # Code completion is its own household policy, whatever app's token sends it.
        wanted = FIM_CLASS
    wanted = wanted or principal.default_class
    policy = services().classes.get(wanted)
    if policy is None:
        raise ApiError(400, f"unknown class '{wanted}'; known classes: {', '.join(services().classes.names())}",
                       param="X-Hearth-Class", code="unknown_class")
    if not principal.may_use(wanted):
        allowed = ", ".join(sorted({principal.default_class, *principal.allowed_classes}))
        raise ApiError(403, f"this token may not use class '{wanted}' (allowed: {allowed})",
                       code="class_not_allowed", err_type="permission_error")
    return policy


@bp.post("/v1/chat/completions")
def chat_completions():
    """OpenAI chat completions through the household's classes."""
    return _serve(ChatBody, "/v1/chat/completions")


@bp.post("/v1/completions")
def completions():
    """OpenAI text completions through the household's classes."""
    return _serve(CompletionBody, "/v1/completions")


@bp.post("/v1/embeddings")
def embeddings():
    """OpenAI embeddings through the household's classes (the model's runner embeds them)."""
    return _serve(EmbeddingBody, "/v1/embeddings")


@bp.post("/infill")
def infill():
    """llama-server's fill-in-the-middle endpoint (code completion plugins such as llama.vim)."""
    return _serve(InfillBody, "/infill")


@bp.get("/v1/models")
def models():
    """Usable models (resident or loadable) and their aliases."""
    _authenticate()
    return {"object": "list", "data": services().router.model_list()}


def _serve(schema, path: str, shape=None):
    """Relay one generation; `shape` (app.gateway.ollama's) reads the body and writes the answer in its own API."""
    arrival_s = time.monotonic()
    arrival_at = datetime.now(UTC)
    principal = _authenticate()
    body, raw = _parse(schema) if shape is None else shape.parse(schema)
    features = tuple(body.features)
    policy = _choose_class(principal, raw.get("hearth_class"), fim="fim" in features)
    h = services()
    model_name = h.router.resolve(body.model, policy)
    requested = body.max_completion_tokens if isinstance(body, ChatBody) and body.max_completion_tokens else body.max_tokens
    if isinstance(body, InfillBody) and requested is None:
        requested = body.n_predict
    if requested is not None and requested > policy.max_output_tokens:
        raise ApiError(400, f"'max_tokens': {requested} is above class '{policy.name}''s cap of "
                            f"{policy.max_output_tokens}", param="max_tokens", code="max_tokens_above_cap")
    forward = dict(raw)
    forward["max_tokens"] = requested or policy.default_max_tokens
    forward.pop("max_completion_tokens", None)
    forward.pop("n_predict", None)
    forward["priority"] = policy.priority
    forward["hearth_class"] = policy.name
    forward["model"] = model_name
    record = {
        "arrival_at": arrival_at, "member_name": principal.member, "token_id": principal.token_id,
        "class_name": policy.name, "model": model_name, "stream": bool(body.stream),
        "features": ",".join(features) or None,
    }
    ex = Exchange(h, record, arrival_s)
    ticket = ex.admit(policy)
    try:
        if ticket.queue_position and client_gone(request.environ):
            # Left while queued (a flood's abandoned requests): no runner is asked for a prefill.
            ex.finish(relay.RelayOutcome(status=CLIENT_CLOSED, error="the client left while waiting for admission"),
                      status="cancelled")
            return Response(status=CLIENT_CLOSED)
        lease = ex.acquire(model_name)
        headers = {"X-Hearth-Class": policy.name, "X-Hearth-Model": header_value(model_name),
                   "X-Hearth-Node": header_value(lease.node_label)}
        if ticket.queue_position:
            headers["X-Hearth-Queue-Position"] = str(ticket.queue_position)
        url = lease.url.rstrip("/") + path
        if body.stream:
            return _stream(ex, url, forward, headers, shape)
        return _complete(ex, url, forward, headers, shape, generates=schema is not EmbeddingBody)
    except ApiError as err:
        ex.finish(relay.RelayOutcome(status=err.status, error=err.message))  # a no-op when already finished
        raise
    except BaseException:
        # Whatever went wrong before the answer was handed over: place and lease go back, the row is
        # logged (a stream hands its bookkeeping to its generator, whose finally ends it).
        ex.finish(relay.RelayOutcome(status=500, error="the gateway failed before answering"))
        raise



def _complete(ex: Exchange, url, forward, headers, shape=None, generates: bool = True):
    resp, outcome = ex.send(relay.post, url, forward)
    if resp.status_code == 503:
        ex.h.residency.report_busy(ex.lease)  # loading or full: an answer, not a failure of the node
    elif outcome.runner_fault:
        ex.h.residency.report_failure(ex.lease, outcome.error or f"HTTP {resp.status_code}")
    out_headers = dict(headers)
    if "retry-after" in resp.headers:
        out_headers["Retry-After"] = resp.headers["retry-after"]
    content = resp.content if shape is None else shape.complete(resp.status_code, resp.content)
    if generates and resp.status_code == 200:
        # A whole answer reaches the client all at once: its first token goes out now.
        ex.first_token_s = time.monotonic()
    ex.finish(outcome)
    return Response(content, status=resp.status_code, headers=out_headers, mimetype="application/json")


def _stream(ex: Exchange, url, forward, headers, shape=None):
    resp, outcome = ex.send(relay.open_stream, url, forward)
    if resp.status_code != 200:
        content = resp.read()
        retry_after = resp.retry_after
        resp.close()
        try:
            relay.read_summary(json.loads(content), outcome)
        except ValueError:
            outcome.error = content[:500].decode(errors="replace")
        ex.finish(outcome)
        if resp.status_code == 503:
            ex.h.residency.report_busy(ex.lease)  # loading or full: an answer, not a failure of the node
        if shape is not None:
            content = shape.complete(resp.status_code, content)
        out_headers = dict(headers)
        if retry_after is not None:
            out_headers["Retry-After"] = retry_after
        return Response(content, status=resp.status_code, headers=out_headers, mimetype="application/json")
    stall_s = float(ex.h.settings.get("client_stall_s"))

    def generate():
        completed = False
        handed_s = time.monotonic()
        try:
            chunks = relay.stream_chunks(resp, outcome)
            for piece in chunks if shape is None else shape.stream(chunks):
                handed_s = time.monotonic()
                yield piece
                # Back here once the server has written the piece to the client's connection.
                if ex.first_token_s is None and outcome.token_seen:
                    ex.first_token_s = time.monotonic()
            completed = True
        finally:
            # Runs on normal end and when the client goes away or stops reading (the server closes
            # the generator): closing the upstream response makes the runner cancel the sequence.
            resp.close()
            status = None
            if not completed:
                stalled = time.monotonic() - handed_s >= STALL_SHARE * stall_s
                status = CLIENT_STALLED if stalled else "cancelled"
                if stalled:
                    outcome.error = f"the client read nothing for {stall_s:g} s (client_stall_s): cancelled"
            ex.finish(outcome, status=status)

    return Response(stream_with_context(generate()), status=200, headers={**headers, "Cache-Control": "no-cache"},
                    mimetype="text/event-stream" if shape is None else shape.stream_mimetype)
