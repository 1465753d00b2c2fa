"""The OpenAI-compatible gateway's routes (/v1, /infill, /metrics, /healthz): each generation through
app.gateway.pipeline, its runner's answer passed through as it comes."""

from __future__ import annotations

from flask import Blueprint, Response

from app.gateway.context import services
from app.gateway.pipeline import authenticate, error_response, serve_generation
from app.protocols.openai import ApiError, ChatBody, CompletionBody, EmbeddingBody, InfillBody

bp = Blueprint("gateway", __name__)


@bp.errorhandler(ApiError)
def _api_error(err: ApiError):
    return error_response(err)


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
