"""The gateway's OpenAPI 3.1 description: every route it serves (OpenAI's, Anthropic's Messages, OpenAI's
Responses, Ollama's) with its request body and error shape.

The OpenAI bodies are generated from the same pydantic models that validate requests: a field added to
ChatBody shows up here, so clients and the fuzzing suite (tests/gateway/test_fuzz_routes.py) always see
what the gateway really accepts. The other APIs' adapters read their bodies field by field into an
OpenAI request (validated by ChatBody then), so their schemas below name the fields those adapters read.
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
    EmbeddingBody,
    InfillBody,
)
from app.protocols.speech import SpeechBody

REF = "#/components/schemas/{model}"

_ERRORS = {
    "400": "Invalid request: the message names the field and what to fix",
    "401": "Missing, invalid or revoked API token",
    "403": "The token may not use the requested class",
    "404": "Unknown model, or a model file that cannot be served",
    "409": "The model is busy, embedded or pinned, or the name is taken",
    "413": f"Request body larger than {MAX_GENERATION_BODY_BYTES:,} bytes on a generation route (room for one image of "
           f"{MAX_IMAGE_BYTES:,} bytes as base64), {MAX_BODY_BYTES:,} on the others",
    "429": "The class's queue is full (see Retry-After)",
    "502": "The model's runner failed while answering; it is restarted on the next request",
    "501": "Not something Hearth does (the message says what to do instead)",
    "503": "Queue timeout, model still loading or not enough memory (see Retry-After)",
    "507": "The models folder's disk is full",
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


def _ollama_error_schema() -> dict:
    return {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}


def _anthropic_error_schema() -> dict:
    return {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"],
                  "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}


def _responses(success: str, media: str = "application/json", errors: tuple[str, ...] = tuple(_ERRORS),
               error: str = "Error", streams: str | None = None) -> dict:
    out: dict = {"200": {"description": success, "content": {media: {"schema": {}}}}}
    if streams:
        out["200"]["content"][streams] = {"schema": {"type": "string"}}
    for status in errors:
        out[status] = {"description": _ERRORS[status],
                       "content": {"application/json": {"schema": {"$ref": REF.format(model=error)}}}}
    return out


# Ollama's generation and model-management routes answer their errors as {"error": "message"}.
_OLLAMA_ERRORS = ("400", "401", "403", "404", "413", "429", "502", "503")
_JSON_VALUE: dict = {}
_STRING = {"type": "string"}
_OBJECT = {"type": "object"}
_MESSAGES = {"type": "array", "items": {"type": "object", "required": ["role"],
                                         "properties": {"role": _STRING, "content": _JSON_VALUE}}}
_NAME = {"type": "string", "description": "a model of the catalog, or one of its aliases (Ollama's name:tag form)"}
_KEEP_ALIVE = {"type": ["string", "number"], "description": "how long the model stays loaded once idle (a duration "
                                                           "such as 5m, seconds, 0 to unload, -1 for ever)"}

# The other APIs' bodies, as their adapters read them (app.protocols.anthropic, .responses, .ollama).
_HAND_WRITTEN = {
    "MessagesBody": {"type": "object", "required": ["model", "messages", "max_tokens"], "properties": {
        "model": _STRING, "messages": _MESSAGES, "max_tokens": {"type": "integer", "minimum": 1},
        "system": {"type": ["string", "array"]}, "stream": {"type": "boolean"},
        "temperature": {"type": "number"}, "top_p": {"type": "number"}, "top_k": {"type": "integer"},
        "stop_sequences": {"type": "array", "items": _STRING}, "tools": {"type": "array", "items": _OBJECT},
        "tool_choice": _OBJECT, "thinking": _OBJECT, "metadata": _OBJECT}},
    "ResponsesBody": {"type": "object", "required": ["model", "input"], "properties": {
        "model": _STRING, "input": {"type": ["string", "array"]}, "instructions": {"type": ["string", "null"]},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1}, "stream": {"type": "boolean"},
        "temperature": {"type": "number"}, "top_p": {"type": "number"},
        "tools": {"type": "array", "items": _OBJECT}, "tool_choice": {"type": ["string", "object"]},
        "parallel_tool_calls": {"type": "boolean"}, "text": _OBJECT,
        "reasoning": {"type": ["object", "null"], "properties": {"effort": {"type": ["string", "null"]}}},
        "previous_response_id": {"type": ["string", "null"], "description": "refused: Hearth keeps no responses"}}},
    "OllamaChatBody": {"type": "object", "required": ["model"], "properties": {
        "model": _NAME, "messages": _MESSAGES, "tools": {"type": "array", "items": _OBJECT},
        "format": {"type": ["string", "object"]}, "options": _OBJECT, "stream": {"type": "boolean"},
        "keep_alive": _KEEP_ALIVE, "think": {"type": ["boolean", "string"]}}},
    "OllamaGenerateBody": {"type": "object", "required": ["model"], "properties": {
        "model": _NAME, "prompt": _STRING, "suffix": _STRING, "system": _STRING, "template": _STRING,
        "raw": {"type": "boolean"}, "images": {"type": "array", "items": _STRING},
        "format": {"type": ["string", "object"]}, "options": _OBJECT, "stream": {"type": "boolean"},
        "keep_alive": _KEEP_ALIVE, "think": {"type": ["boolean", "string"]},
        "context": {"type": "array", "items": {"type": "integer"}}}},
    "OllamaEmbedBody": {"type": "object", "required": ["model", "input"], "properties": {
        "model": _NAME, "input": {"type": ["string", "array"], "items": _STRING}, "truncate": {"type": "boolean"},
        "options": _OBJECT, "keep_alive": _KEEP_ALIVE}},
    "OllamaEmbeddingsBody": {"type": "object", "required": ["model", "prompt"], "properties": {
        "model": _NAME, "prompt": _STRING, "options": _OBJECT, "keep_alive": _KEEP_ALIVE}},
    "OllamaModelBody": {"type": "object", "required": ["model"], "properties": {
        "model": _NAME, "name": _NAME, "verbose": {"type": "boolean"}}},
    "OllamaPullBody": {"type": "object", "required": ["model"], "properties": {
        "model": {"type": "string", "description": "hf.co/owner/repo:QUANT, owner/repo/file.gguf or a URL"},
        "insecure": {"type": "boolean"}, "stream": {"type": "boolean"}}},
    "OllamaCopyBody": {"type": "object", "required": ["source", "destination"], "properties": {
        "source": _NAME, "destination": _STRING}},
}


def _post(schema_name: str, summary: str, success: str, errors: tuple[str, ...] = tuple(_ERRORS),
          error: str = "Error", streams: str | None = None, method: str = "post") -> dict:
    return {method: {
        "summary": summary, "security": [{"bearerAuth": []}],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": REF.format(model=schema_name)}}}},
        "responses": _responses(success, errors=errors, error=error, streams=streams),
    }}


def _transcription() -> dict:
    """OpenAI's transcription upload (multipart), as llama-server takes it."""
    fields = {"file": {"type": "string", "format": "binary", "description": "WAV, MP3 or FLAC"},
              "model": {"type": "string"}, "prompt": {"type": "string"}, "language": {"type": "string"},
              "response_format": {"enum": ["json", "text", "verbose_json", "srt", "vtt"], "default": "json"},
              "temperature": {"type": "number"}, "max_tokens": {"type": "integer"},
              "stream": {"type": "boolean", "default": False}, "hearth_class": {"type": "string"}}
    return {"post": {
        "summary": "Speech to text (OpenAI's transcription upload; the chat route of an audio model answers it)",
        "security": [{"bearerAuth": []}],
        "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["file"], "properties": fields}}}},
        "responses": _responses("Transcript (transcript.text.done JSON; text, srt or vtt as asked; server-sent "
                                "transcript.text.delta events when stream is true)", streams="text/event-stream"),
    }}


def _get(summary: str, success: str, errors: tuple[str, ...] = ("401",), media: str = "application/json",
         security: bool = True, **extra) -> dict:
    return {"get": {"summary": summary, "security": [{"bearerAuth": []}] if security else [],
                    "responses": _responses(success, media, errors=errors), **extra}}


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
        "responses": _responses("Completion (JSON, or server-sent events when stream is true)",
                                streams="text/event-stream"),
    }}


def _ollama_paths() -> dict:
    ndjson = "application/x-ndjson"
    err = {"errors": _OLLAMA_ERRORS, "error": "OllamaError"}
    manage = {"errors": ("400", "401", "403", "404", "409", "413"), "error": "OllamaError"}
    return {
        "/api/version": _get("The Ollama API version this gateway follows", "Version", errors=(), security=False),
        "/api/tags": _get("Models, Ollama's list", "Model list"),
        "/api/ps": _get("Loaded models, Ollama's list", "Loaded models"),
        "/api/show": _post("OllamaModelBody", "A model's details, template and capabilities", "Details", **err),
        "/api/chat": _post("OllamaChatBody", "Ollama chat", "Answer (NDJSON lines unless stream is false)",
                           streams=ndjson, **err),
        "/api/generate": _post("OllamaGenerateBody", "Ollama generate", "Answer (NDJSON lines unless stream is false)",
                               streams=ndjson, **err),
        "/api/embed": _post("OllamaEmbedBody", "Ollama embeddings", "Embeddings", **err),
        "/api/embeddings": _post("OllamaEmbeddingsBody", "Ollama's older embeddings route", "Embedding", **err),
        "/api/pull": _post("OllamaPullBody", "Pull a GGUF (manage permission)", "Progress (NDJSON)", streams=ndjson,
                           errors=(*manage["errors"], "502", "507"), error="OllamaError"),
        "/api/delete": _post("OllamaModelBody", "Delete a model file (manage permission)", "Deleted", method="delete",
                             **manage),
        "/api/copy": _post("OllamaCopyBody", "Name a model anew, as an alias (manage permission)", "Copied", **manage),
        "/api/create": _post("OllamaModelBody", "Refused (501): Hearth builds no models from Modelfiles", "Never",
                             errors=("401", "403", "501"), error="OllamaError"),
        "/api/push": _post("OllamaModelBody", "Refused (501): Hearth pushes to no registry", "Never",
                           errors=("401", "403", "501"), error="OllamaError"),
    }


@cache
def openapi_document() -> dict:
    """The OpenAPI document of the gateway (built once per process)."""
    models = [(ChatBody, "validation"), (CompletionBody, "validation"), (InfillBody, "validation"),
              (EmbeddingBody, "validation"), (SpeechBody, "validation")]
    _, defs = models_json_schema(models, ref_template=REF)
    schemas = {**defs["$defs"], **_HAND_WRITTEN}
    schemas["Error"] = _error_schema()
    schemas["OllamaError"] = _ollama_error_schema()
    schemas["AnthropicError"] = _anthropic_error_schema()
    model_id = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Hearth gateway", "version": "1",
                 "description": "The household's LLM server: OpenAI's API, Anthropic's Messages, OpenAI's "
                                "Responses and Ollama's API, each with its own error shape."},
        "paths": {
            "/v1/chat/completions": _generation("ChatBody", "Chat completion"),
            "/v1/completions": _generation("CompletionBody", "Text completion (fill-in-the-middle with suffix)"),
            "/infill": _generation("InfillBody", "Code completion, llama-server's fill-in-the-middle shape"),
            "/v1/embeddings": _post("EmbeddingBody", "Embeddings", "Embeddings"),
            "/v1/messages": _post("MessagesBody", "Anthropic's Messages API",
                                  "Message (JSON, or server-sent events when stream is true)",
                                  error="AnthropicError", streams="text/event-stream"),
            "/v1/responses": _post("ResponsesBody", "OpenAI's Responses API (stateless)",
                                   "Response (JSON, or server-sent events when stream is true)",
                                   streams="text/event-stream"),
            **{p: _transcription() for p in ("/v1/audio/transcriptions", "/audio/transcriptions")},
            **{p: _post("SpeechBody", "Text to speech (OpenAI's speech API; a Piper voice speaks)",
                        "Audio in the asked format, chunked as it is written (server-sent speech.audio.delta events "
                        "with stream_format sse)", streams="text/event-stream")
               for p in ("/v1/audio/speech", "/audio/speech")},
            "/v1/models": _get("Models that can be served, and their aliases", "Model list"),
            "/v1/models/{model}": _get("One model (OpenAI's retrieve-model route)", "Model",
                                       errors=("401", "404"), parameters=[model_id]),
            **_ollama_paths(),
            "/healthz": _get("Liveness", "Serving", errors=(), security=False),
            "/metrics": _get("Prometheus text exposition (a token where metrics_require_token asks for one)",
                             "Metrics", errors=("401",), media="text/plain", security=False),
            "/openapi.json": _get("This description", "OpenAPI 3.1 document", errors=(), security=False),
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                               "description": "an API token from `hearth token create`"}},
        },
        "security": [{"bearerAuth": []}],
    }
