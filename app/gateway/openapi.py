"""The gateway's OpenAPI 3.1 description, generated from the same pydantic models that validate requests.

Generated, never hand-written: a field added to ChatBody shows up here, so clients and the fuzzing
suite always see what the gateway really accepts.
"""

from __future__ import annotations

from functools import cache

from pydantic.json_schema import models_json_schema

from app.protocols.openai import (
    MAX_BODY_BYTES,
    MAX_GENERATION_BODY_BYTES,
    MAX_IMAGE_BYTES,
    UNSUPPORTED,
    ChatBody,
    CompletionBody,
    InfillBody,
)

REF = "#/components/schemas/{model}"

_ERRORS = {
    "400": "Invalid request: the message names the field and what to fix",
    "401": "Missing, invalid or revoked API token",
    "403": "The token may not use the requested class",
    "404": "Unknown model, or a model file that cannot be served",
    "413": f"Request body larger than {MAX_GENERATION_BODY_BYTES:,} bytes on a generation route (room for one image of "
           f"{MAX_IMAGE_BYTES:,} bytes as base64), {MAX_BODY_BYTES:,} on the others",
    "429": "The class's queue is full (see Retry-After)",
    "502": "The model's runner failed while answering; it is restarted on the next request",
    "503": "Queue timeout, model still loading or not enough memory (see Retry-After)",
}


def _error_schema() -> dict:
    return {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }},
    }


def _responses(success: str, media: str = "application/json", errors: tuple[str, ...] = tuple(_ERRORS)) -> dict:
    out: dict = {"200": {"description": success, "content": {media: {"schema": {}}}}}
    if media == "application/json" and success.startswith("Completion"):
        out["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    for status in errors:
        out[status] = {"description": _ERRORS[status],
                       "content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
    return out


def _generation(schema_name: str, summary: str) -> dict:
    return {"post": {
        "summary": summary,
        "description": "Classes: send `X-Hearth-Class` (or `hearth_class` in the body) to pick one the token "
                       "allows. Not supported, and refused by name: " + ", ".join(sorted(UNSUPPORTED)) + ".",
        "security": [{"bearerAuth": []}],
        "parameters": [{"name": "X-Hearth-Class", "in": "header", "required": False, "schema": {"type": "string"},
                        "description": "request class (default: the token's)"}],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": REF.format(model=schema_name)}}}},
        "responses": _responses("Completion (JSON, or server-sent events when stream is true)"),
    }}


@cache
def openapi_document() -> dict:
    """The OpenAPI document of the gateway (built once per process)."""
    _, defs = models_json_schema([(ChatBody, "validation"), (CompletionBody, "validation"), (InfillBody, "validation")],
                                 ref_template=REF)
    schemas = dict(defs["$defs"])
    schemas["Error"] = _error_schema()
    return {
        "openapi": "3.1.0",
        "info": {"title": "Hearth gateway", "version": "1",
                 "description": "OpenAI-compatible API of the household's LLM server."},
        "paths": {
            "/v1/chat/completions": _generation("ChatBody", "Chat completion"),
            "/v1/completions": _generation("CompletionBody", "Text completion (fill-in-the-middle with suffix)"),
            "/infill": _generation("InfillBody", "Code completion, llama-server's fill-in-the-middle shape"),
            "/v1/models": {"get": {"summary": "Models that can be served, and their aliases",
                                   "security": [{"bearerAuth": []}],
                                   "responses": _responses("Model list", errors=("401",))}},
            "/healthz": {"get": {"summary": "Liveness", "security": [],
                                 "responses": {"200": {"description": "Serving",
                                                       "content": {"application/json": {"schema": {}}}}}}},
            "/metrics": {"get": {"summary": "Prometheus text exposition", "security": [],
                                 "responses": {"200": {"description": "Metrics",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                               "description": "an API token from `hearth token create`"}},
        },
        "security": [{"bearerAuth": []}],
    }
