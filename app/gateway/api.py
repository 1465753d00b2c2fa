"""The OpenAI-compatible gateway's routes (/v1, /infill, /metrics, /healthz): each generation through
app.gateway.pipeline, its runner's answer passed through as it comes."""

from __future__ import annotations

import ipaddress

from flask import Blueprint, Response, request

from app.gateway import bodies
from app.gateway.auth import bearer_token
from app.gateway.context import services
from app.gateway.pipeline import authenticate, serve_generation
from app.protocols.openai import ApiError, ChatBody, CompletionBody, EmbeddingBody, InfillBody

bp = Blueprint("gateway", __name__)
bodies.install(bp, bodies.openai_shape)


@bp.get("/metrics")
def metrics():
    """Prometheus text: per-class requests, tokens, TTFT/TPOT/queue histograms, residency gauges."""
    _check_metrics_token()
    return Response(services().metrics.render(), mimetype="text/plain; version=0.0.4")


def _check_metrics_token() -> None:
    """Refuse /metrics without a valid API token where the metrics_require_token setting asks for one."""
    svc = services()
    required = svc.settings.get("metrics_require_token")
    if required == "never" or (required == "off_machine" and _from_this_machine(request.remote_addr)):
        return
    token = bearer_token(request.headers.get("Authorization"))
    where = "from this client" if required == "off_machine" else "here"
    if token is None:
        raise ApiError(401, f"/metrics needs an API token {where} (setting metrics_require_token = {required}): send "
                            "'Authorization: Bearer <token>'; in Prometheus, put the token under the scrape job's "
                            "authorization: credentials", code="missing_token", err_type="authentication_error",
                       headers={"WWW-Authenticate": "Bearer"})
    if svc.tokens.lookup(token) is None:
        raise ApiError(401, "invalid or revoked API token", code="invalid_token", err_type="authentication_error",
                       headers={"WWW-Authenticate": "Bearer"})


def _from_this_machine(addr: str | None) -> bool:
    try:
        return ipaddress.ip_address(addr or "").is_loopback
    except ValueError:
        return False


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


@bp.post("/v1/chat/completions")
def chat_completions():
    """OpenAI chat completions through the household's classes."""
    return serve_generation(ChatBody, "/v1/chat/completions")


@bp.post("/v1/completions")
def completions():
    """OpenAI text completions through the household's classes."""
    return serve_generation(CompletionBody, "/v1/completions")


@bp.post("/v1/embeddings")
def embeddings():
    """OpenAI embeddings through the household's classes (the model's runner embeds them)."""
    return serve_generation(EmbeddingBody, "/v1/embeddings")


@bp.post("/infill")
def infill():
    """llama-server's fill-in-the-middle endpoint (code completion plugins such as llama.vim)."""
    return serve_generation(InfillBody, "/infill")


@bp.get("/v1/models")
def models():
    """Usable models (resident or loadable) and their aliases."""
    authenticate()
    return {"object": "list", "data": services().router.model_list()}


@bp.get("/v1/models/<path:model>")
def retrieve_model(model: str):
    """OpenAI's retrieve-model route: one entry of /v1/models, or a 404 in OpenAI's shape."""
    authenticate()
    entry = next((m for m in services().router.model_list() if m["id"] == model), None)
    if entry is None:
        raise ApiError(404, f"The model '{model}' does not exist; GET /v1/models lists the models here",
                       param="model", code="model_not_found")
    return entry
