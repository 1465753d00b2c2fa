"""The Ollama API (/api/*) on the gateway: each request is translated to its OpenAI shape and takes
the same path a /v1 request takes (token → member → class → admission → model → runner → relay);
the runner's answer is translated back, NDJSON line by line when streamed.

Home Assistant's Ollama integration, Open WebUI and Continue speak this API. Ollama's names carry a
tag (`gemma:latest`); a name without one is its `:latest`. `keep_alive` is a client's wish for how
long its model stays resident once idle; the residency manager keeps an admin's pin whatever a
client asks. Pull, copy and delete change the models folder: they answer only while the setting
`api_manage_models` is on (the dashboard and `hearth models pull` always can).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from flask import Blueprint, Response, request, stream_with_context
from pydantic import ValidationError
from sqlalchemy import select

from app.engine.chat import load_chat_template
from app.gateway.api import _authenticate, _serve
from app.gateway.context import services
from app.gguf_meta import GgufArray, GgufError, read_metadata
from app.protocols.openai import ApiError, ChatBody, CompletionBody, EmbeddingBody, validation_error
from app.residency.manager import ModelBusy, UnknownModel
from app.store import models as db

bp = Blueprint("ollama", __name__)

# The Ollama release whose API this follows; clients that check a minimum version read it.
OLLAMA_VERSION = "0.12.6"
DEFAULT_TAG = "latest"
NDJSON = "application/x-ndjson"
NS_PER_MS = 1_000_000
PULL_POLL_S = 0.25
# What /api/ps says for a model that never expires (pinned, or keep_alive -1), as Ollama does.
NEVER = datetime(2318, 1, 1, tzinfo=UTC)
# Ollama's option names with their OpenAI (and Hearth) names; other options are ignored, as Ollama
# ignores options a runner does not know. num_ctx is the admin's runner setting, not a client's.
OPTION_NAMES = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "stop": "stop",
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


# -- errors ----------------------------------------------------------------------------------------


def _error(err: ApiError) -> Response:
    """Ollama's error shape: {"error": "message"} (its clients raise ResponseError with it)."""
    return Response(json.dumps({"error": err.message}), status=err.status, headers=err.headers,
                    mimetype="application/json")


@bp.errorhandler(ApiError)
def _api_error(err: ApiError):
    return _error(err)


def error_message(content: bytes) -> str:
    """The message of an OpenAI-shaped error body (as runners and /v1 answer), else its text."""
    try:
        payload = json.loads(content)
    except ValueError:
        return content[:500].decode("utf-8", "replace")
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err if err is not None else payload)


# -- names and durations ---------------------------------------------------------------------------


def ollama_name(name: str) -> str:
    """Hearth's model name as Ollama lists it: with a tag, `:latest` when it has none."""
    return name if ":" in name else f"{name}:{DEFAULT_TAG}"


def hearth_name(requested: str, known: set[str]) -> str:
    """The catalog name or alias an Ollama name means: as given, else without its `:latest`."""
    if requested in known:
        return requested
    base, _, tag = requested.rpartition(":")
    if base and tag == DEFAULT_TAG and base in known:
        return base
    return requested


def parse_keep_alive(value: Any) -> float | None:
    """Ollama's keep_alive in seconds: a number of seconds or a Go duration ("5m", "1h30m", "-1");
    negative means keep it loaded (inf), 0 unload after the request; None when not given."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ApiError(400, "'keep_alive' must be a duration such as \"5m\" or a number of seconds", param="keep_alive")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)  # a bare number is seconds
        except ValueError:
            parts = _DURATION_PART.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ApiError(400, f"'keep_alive': {value!r} is not a duration (e.g. \"5m\", \"1h\", \"-1\" to keep "
                                    "the model loaded, \"0\" to unload it)", param="keep_alive")
            seconds = sign * sum(float(n) * _DURATION_UNITS_S[u] for n, u in parts)
    else:
        raise ApiError(400, "'keep_alive' must be a duration such as \"5m\" or a number of seconds", param="keep_alive")
    return float("inf") if seconds < 0 else seconds


# -- requests: Ollama → OpenAI ---------------------------------------------------------------------


def options_to_openai(options: Any) -> dict:
    """The sampling fields of an Ollama `options` object in OpenAI's names (num_predict → max_tokens)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ApiError(400, "'options' must be an object", param="options")
    out = {OPTION_NAMES[k]: v for k, v in options.items() if k in OPTION_NAMES and v is not None}
    predict = options.get("num_predict")
    # num_predict -1 (no limit) and -2 (fill the context) leave the class's default length.
    if isinstance(predict, int) and not isinstance(predict, bool) and predict > 0:
        out["max_tokens"] = predict
    elif predict is not None and not isinstance(predict, int):
        raise ApiError(400, "'options.num_predict' must be an integer", param="options.num_predict")
    return out


def format_to_response_format(fmt: Any) -> dict | None:
    """Ollama's `format` as OpenAI's response_format: "json" → json_object, a JSON schema → json_schema."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "ollama_format", "schema": fmt, "strict": True}}
    raise ApiError(400, f"'format' must be \"json\" or a JSON schema object, not {fmt!r}", param="format")


def _no_images(images: Any, param: str, model: str) -> None:
    if images:
        raise ApiError(400, f"'{param}': model '{model}' is a text model; Hearth serves no vision models, so images "
                            "cannot be read", param=param, code="images_not_supported")


def messages_to_openai(messages: Any, model: str) -> list[dict]:
    """Ollama chat messages as OpenAI's: tool calls get ids and string arguments, tool results the id
    of the call they answer (by tool name, else in order)."""
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' must be a list", param="messages")
    out: list[dict] = []
    unanswered: list[tuple[str, str]] = []  # (call id, function name) of calls without a result yet
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"'messages.{i}' must be an object", param=f"messages.{i}")
        _no_images(m.get("images"), f"messages.{i}.images", model)
        # Ollama's content is a Go string: missing or null reads as "" there (OpenAI's /v1 requires it).
        msg = {"role": m.get("role"), "content": "" if m.get("content") is None else m.get("content")}
        if m.get("tool_calls"):
            calls = []
            for j, call in enumerate(m["tool_calls"]):
                if not isinstance(call, dict):
                    raise ApiError(400, f"'messages.{i}.tool_calls.{j}' must be an object", param=f"messages.{i}.tool_calls")
                fn = call.get("function") or {}
                args = fn.get("arguments", {})
                call_id = call.get("id") or f"call_{i}_{j}"
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": fn.get("name"), "arguments": args if isinstance(args, str) else json.dumps(args)}})
                unanswered.append((call_id, fn.get("name")))
            msg["tool_calls"] = calls
        if m.get("role") == "tool":
            name = m.get("tool_name") or m.get("name")
            match = next((c for c in unanswered if c[1] == name), unanswered[0] if unanswered else None)
            if m.get("tool_call_id"):
                msg["tool_call_id"] = m["tool_call_id"]
            elif match is not None:
                msg["tool_call_id"] = match[0]
            if match is not None:
                unanswered.remove(match)
            if name:
                msg["name"] = name
        out.append(msg)
    return out


def _common(body: dict) -> dict:
    """Fields /api/chat and /api/generate share: model, stream (Ollama's default: on), options, format."""
    out = {"model": body["model"], "stream": body.get("stream") is not False}
    out.update(options_to_openai(body.get("options")))
    response_format = format_to_response_format(body.get("format"))
    if response_format is not None:
        out["response_format"] = response_format
    if body.get("think") not in (None, False):
        raise ApiError(400, f"'think': model '{body['model']}' does not support thinking", param="think")
    if body.get("logprobs"):
        raise ApiError(400, "'logprobs' is not supported by Hearth; remove it from the request", param="logprobs")
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    return out


def chat_to_openai(body: dict) -> dict:
    """An /api/chat body as a /v1/chat/completions one."""
    out = _common(body)
    out["messages"] = messages_to_openai(body.get("messages") or [], body["model"])
    if body.get("tools"):
        out["tools"] = body["tools"]
    return out


def generate_to_openai(body: dict) -> tuple[dict, str]:
    """An /api/generate body as a /v1 one and its path: the prompt through the model's chat template
    (with `system`), or as it is when `raw`; `suffix` (fill in the middle) is a text completion."""
    model = body["model"]
    _no_images(body.get("images"), "images", model)
    if body.get("template"):
        raise ApiError(400, "'template': Hearth uses the model's own chat template; send 'raw': true with a "
                            "prompt you formatted yourself instead", param="template")
    if body.get("context"):
        raise ApiError(400, "'context' (tokens of an earlier answer) is not supported: Hearth returns none; send "
                            "the conversation to /api/chat instead", param="context")
    out = _common(body)
    prompt = body.get("prompt") or ""
    if body.get("raw") or body.get("suffix"):
        out["prompt"] = prompt
        if body.get("suffix"):
            out["suffix"] = body["suffix"]
        return out, "/v1/completions"
    messages = [{"role": "system", "content": body["system"]}] if body.get("system") else []
    out["messages"] = [*messages, {"role": "user", "content": prompt}]
    return out, "/v1/chat/completions"


# -- answers: OpenAI → Ollama ----------------------------------------------------------------------


def tool_calls_from_openai(calls: list[dict]) -> list[dict]:
    """OpenAI tool calls (arguments as a JSON string) as Ollama's (arguments as an object)."""
    out = []
    for call in calls:
        fn = call.get("function") or {}
        args = fn.get("arguments") or "{}"
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError as exc:
                raise ValueError(f"the model's arguments for tool {fn.get('name')!r} are not JSON ({exc}): {args[:200]}")
        if not isinstance(args, dict):
            raise ValueError(f"the model's arguments for tool {fn.get('name')!r} are not a JSON object: {args!r}")
        out.append({"function": {"name": fn.get("name"), "arguments": args}})
    return out


def _done_reason(finish_reason: str | None) -> str:
    return "stop" if finish_reason in (None, "tool_calls", "function_call") else finish_reason


def _created_at() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _stats(usage: dict | None, timings: dict | None, started_s: float) -> dict:
    """Ollama's counters and nanosecond durations from the runner's usage and timings."""
    usage, timings = usage or {}, timings or {}
    ttft_ms, total_ms = timings.get("ttft_ms"), timings.get("total_ms")
    out = {
        "total_duration": int((time.monotonic() - started_s) * 1e9),
        "load_duration": 0,
        "prompt_eval_count": usage.get("prompt_tokens", 0),
        "prompt_eval_duration": int((ttft_ms or 0) * NS_PER_MS),
        "eval_count": usage.get("completion_tokens", 0),
        "eval_duration": int(max(0.0, (total_ms or 0) - (ttft_ms or 0)) * NS_PER_MS),
    }
    return out


class Shape:
    """One Ollama request on the gateway's path: reads its body as OpenAI's, writes the answer as Ollama's."""

    stream_mimetype = NDJSON

    def __init__(self, kind: str, body: dict, model: str):
        self.kind = kind  # "chat" or "generate"
        self.body = body
        self.model = model  # the name as the client gave it, echoed in every answer
        self.started_s = time.monotonic()

    def parse(self, schema):
        """The translated body validated as /v1 validates its own (the gateway's _serve calls this)."""
        openai_body = chat_to_openai(self.body) if self.kind == "chat" else generate_to_openai(self.body)[0]
        openai_body["model"] = _catalog_name(self.body["model"])
        try:
            return schema.model_validate(openai_body), openai_body
        except ValidationError as exc:
            raise validation_error(exc)

    def _line(self, content: str, done: bool, tool_calls: list | None = None, **extra) -> dict:
        out: dict[str, Any] = {"model": self.model, "created_at": _created_at()}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if tool_calls:
                message["tool_calls"] = tool_calls
            out["message"] = message
        else:
            out["response"] = content
        out["done"] = done
        out.update(extra)
        return out

    def answer(self, payload: dict) -> dict:
        """A whole OpenAI completion as Ollama's answer."""
        choice = (payload.get("choices") or [{}])[0]
        if self.kind == "chat":
            message = choice.get("message") or {}
            text, calls = message.get("content") or "", tool_calls_from_openai(message.get("tool_calls") or [])
        else:
            text, calls = choice.get("text") or (choice.get("message") or {}).get("content") or "", None
        return self._line(text, True, calls, done_reason=_done_reason(choice.get("finish_reason")),
                          **_stats(payload.get("usage"), payload.get("timings"), self.started_s))

    def complete(self, status: int, content: bytes) -> bytes:
        """The runner's whole answer (or error) in Ollama's shape."""
        if status != 200:
            return json.dumps({"error": error_message(content)}).encode()
        try:
            return json.dumps(self.answer(json.loads(content))).encode()
        except ValueError as exc:
            return json.dumps({"error": str(exc)}).encode()

    def stream(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """The runner's SSE events as Ollama's NDJSON lines; tool calls are sent whole, once complete."""
        tail = b""
        calls: dict[int, dict] = {}
        finish = usage = timings = None
        for chunk in chunks:
            tail += chunk
            *events, tail = tail.split(b"\n\n")
            for ev in events:
                data = ev.partition(b"data: ")[2].strip()
                if not data or data == b"[DONE]":
                    continue
                try:
                    payload = json.loads(data)
                except ValueError:
                    continue
                if payload.get("error"):
                    yield _ndjson({"error": error_message(data)})
                    return
                usage = payload.get("usage") or usage
                timings = payload.get("timings") or timings
                for choice in payload.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") if self.kind == "chat" else choice.get("text")
                    if self.kind == "generate" and text is None:
                        text = delta.get("content")
                    for call in delta.get("tool_calls") or []:
                        acc = calls.setdefault(call.get("index", len(calls)), {"function": {"name": "", "arguments": ""}})
                        fn = call.get("function") or {}
                        acc["function"]["name"] += fn.get("name") or ""
                        acc["function"]["arguments"] += fn.get("arguments") or ""
                    if text:
                        yield _ndjson(self._line(text, False))
                    finish = choice.get("finish_reason") or finish
        if calls:
            try:
                whole = tool_calls_from_openai([calls[i] for i in sorted(calls)])
            except ValueError as exc:
                yield _ndjson({"error": str(exc)})
                return
            yield _ndjson(self._line("", False, whole))
        if finish is None:
            yield _ndjson({"error": "the answer ended before the model finished; retry"})
            return
        yield _ndjson(self._line("", True, done_reason=_done_reason(finish), **_stats(usage, timings, self.started_s)))


class EmbedShape(Shape):
    """/api/embed (many inputs) or the older /api/embeddings (one prompt) as /v1/embeddings."""

    def parse(self, schema):
        """The Ollama body as an OpenAI embeddings body."""
        if self.kind == "embeddings":
            inputs = self.body.get("prompt")
        else:
            inputs = self.body.get("input")
        openai_body = {"model": _catalog_name(self.body["model"]), "input": inputs}
        for key in ("truncate", "dimensions"):
            if self.body.get(key) is not None:
                openai_body[key] = self.body[key]
        try:
            return schema.model_validate(openai_body), openai_body
        except ValidationError as exc:
            raise validation_error(exc)

    def answer(self, payload: dict) -> dict:
        """Vectors in Ollama's shape."""
        vectors = [d["embedding"] for d in sorted(payload.get("data") or [], key=lambda d: d["index"])]
        if self.kind == "embeddings":
            return {"embedding": vectors[0] if vectors else []}
        usage = payload.get("usage") or {}
        return {"model": self.model, "embeddings": vectors, "total_duration": int((time.monotonic() - self.started_s) * 1e9),
                "load_duration": 0, "prompt_eval_count": usage.get("prompt_tokens", 0)}


def _ndjson(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


# -- endpoints -------------------------------------------------------------------------------------


def _json_body() -> dict:
    """The request's JSON object (an empty body is an empty object, as Ollama reads it)."""
    raw = request.get_data(cache=True)
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json")
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return data


def _model_field(body: dict) -> str:
    model = body.get("model") or body.get("name")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required", param="model")
    return model


def _known() -> set[str]:
    h = services()
    return set(h.catalog.model_specs()) | set(h.catalog.aliases())


def _catalog_name(requested: str) -> str:
    """The catalog name an Ollama model name means (aliases resolved); 404 when there is none."""
    return services().router.resolve(hearth_name(requested, _known()), None)


def _apply_keep_alive(name: str, body: dict) -> float | None:
    ttl = parse_keep_alive(body.get("keep_alive"))
    try:
        services().residency.set_client_keep_alive(name, ttl)
    except UnknownModel:
        raise ApiError(404, f"model '{name}' not found", param="model", code="model_not_found")
    return ttl


@bp.route("/api/version", methods=["GET", "HEAD"])
def version():
    """The Ollama API version this gateway follows (open, as Ollama's is: it says nothing about the household)."""
    return {"version": OLLAMA_VERSION}


def _details(entry) -> dict:
    family = entry.architecture or ""
    n = entry.n_params or 0
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    return {"parent_model": "", "format": "gguf", "family": family, "families": [family] if family else None,
            "parameter_size": size, "quantization_level": entry.quantization or ""}


def _digest(entry) -> str:
    """A stable identity of the file (path, size, modification time): hashing gigabytes per listing would
    stall the clients that poll it; the library's pull checks the real sha256."""
    return hashlib.sha256(f"{entry.path}\0{entry.size_bytes}\0{entry.mtime}".encode()).hexdigest()


def _entries() -> dict[str, Any]:
    h = services()
    specs = h.catalog.model_specs()
    return {e.name: e for e in h.catalog.entries if e.usable and e.name in specs}


def _modified_at(entry) -> str:
    return datetime.fromtimestamp(entry.mtime or 0, UTC).isoformat()


@bp.get("/api/tags")
def tags():
    """Servable models (and their aliases) in Ollama's list shape."""
    _authenticate()
    h = services()
    entries = _entries()
    names = [(n, n) for n in entries] + sorted((a, n) for a, n in h.catalog.aliases().items() if n in entries)
    return {"models": [{"name": ollama_name(shown), "model": ollama_name(shown), "modified_at": _modified_at(entries[n]),
                        "size": entries[n].size_bytes, "digest": _digest(entries[n]), "details": _details(entries[n])}
                       for shown, n in names]}


@bp.get("/api/ps")
def ps():
    """Resident models: memory, and when an idle expiry will unload them (from keep-alive)."""
    _authenticate()
    h = services()
    entries, specs = _entries(), h.catalog.model_specs()
    now = datetime.now(UTC)
    models = []
    for st in h.residency.status():
        e = entries.get(st["name"])
        if e is None or st["state"] != "ready" or st["pid"] is None:
            continue
        runner = specs[st["name"]].runner
        size = st["measured_bytes"] or st["estimate_bytes"]
        expires = NEVER if st["expires_in_s"] is None else now + timedelta(seconds=st["expires_in_s"])
        models.append({"name": ollama_name(e.name), "model": ollama_name(e.name), "size": size,
                       "digest": _digest(e), "details": _details(e), "expires_at": expires.isoformat(),
                       "size_vram": size if runner and runner.gpu_layers else 0,
                       "context_length": runner.n_ctx if runner else None})
    return {"models": models}


def _model_info(fields: dict) -> dict:
    """The GGUF metadata as Ollama's model_info: long arrays (vocabulary, merges) are null, as there."""
    out = {}
    for key, value in fields.items():
        if isinstance(value, GgufArray):
            value = None
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, bytes | bytearray):
            continue
        out[key] = value
    return out


def capabilities(fields: dict, template: str | None) -> list[str]:
    """What a model can do, from its GGUF: completion (a generative model), tools (its template takes
    them), insert (it has fill-in-the-middle tokens), embedding (every hearth runner can embed)."""
    arch = fields.get("general.architecture")
    caps = []
    if fields.get(f"{arch}.pooling_type") in (None, 0):
        caps.append("completion")
    if template and "tools" in template:
        caps.append("tools")
    if any(f"tokenizer.ggml.{k}_token_id" in fields for k in ("fim_pre", "fim_suf", "prefix", "suffix")):
        caps.append("insert")
    caps.append("embedding")
    return caps


@bp.post("/api/show")
def show():
    """A model's template, parameters, GGUF metadata and capabilities."""
    _authenticate()
    body = _json_body()
    name = _catalog_name(_model_field(body))
    h = services()
    entry = _entries().get(name)
    if entry is None:
        raise ApiError(404, f"model '{body.get('model')}' not found", param="model", code="model_not_found")
    try:
        fields = dict(read_metadata(entry.path).fields)
    except (GgufError, OSError) as exc:
        raise ApiError(500, f"cannot read {entry.path}: {exc}", err_type="server_error")
    # The template the runner prompts it with: its own, else its architecture's built-in one, else ChatML.
    template = load_chat_template(entry.path).source
    runner = h.catalog.model_specs()[name].runner
    parameters = f"num_ctx {runner.n_ctx}" if runner else ""
    modelfile = f"# Modelfile of Hearth's model {name}\nFROM {entry.path}\n" + (f"PARAMETER {parameters}\n" if parameters else "")
    info = _model_info(fields)
    info["general.parameter_count"] = entry.n_params
    return {"modelfile": modelfile, "parameters": parameters, "template": template or "", "details": _details(entry),
            "model_info": info, "capabilities": capabilities(fields, template), "modified_at": _modified_at(entry)}


def _load_or_unload(kind: str, body: dict, name: str, ttl: float | None):
    """A chat/generate request with nothing to say: Ollama's way to load a model, or unload it (keep_alive 0)."""
    h = services()
    if ttl == 0:
        if h.catalog.model_specs()[name].policy == "pinned":
            raise ApiError(409, f"model '{name}' is pinned by the household's admin and stays resident",
                           code="model_pinned")
        try:
            h.residency.unload(name, "keep_alive 0 from a client")
        except ModelBusy:
            pass  # keep_alive 0 is set: it is unloaded as soon as its requests end
        reason = "unload"
    else:
        h.router.acquire(name).release()
        reason = "load"
    shape = Shape(kind, body, body["model"])
    line = shape._line("", True, done_reason=reason)
    if body.get("stream") is not False:
        return Response(_ndjson(line), mimetype=NDJSON)
    return line


def _generation(kind: str):
    _authenticate()
    body = _json_body()
    body["model"] = _model_field(body)
    name = _catalog_name(body["model"])
    ttl = _apply_keep_alive(name, body)
    empty = not body.get("messages") if kind == "chat" else not body.get("prompt") and not body.get("suffix")
    if empty:
        return _load_or_unload(kind, body, name, ttl)
    shape = Shape(kind, body, body["model"])
    if kind == "chat":
        return _serve(ChatBody, "/v1/chat/completions", shape)
    _, path = generate_to_openai(body)
    return _serve(ChatBody if path.endswith("chat/completions") else CompletionBody, path, shape)


@bp.post("/api/chat")
def chat():
    """Ollama chat through the household's classes: NDJSON when streamed (Ollama's default)."""
    return _generation("chat")


@bp.post("/api/generate")
def generate():
    """Ollama generate through the household's classes: the prompt in the model's template, or raw."""
    return _generation("generate")


def _embedding(kind: str):
    _authenticate()
    body = _json_body()
    body["model"] = _model_field(body)
    _apply_keep_alive(_catalog_name(body["model"]), body)
    return _serve(EmbeddingBody, "/v1/embeddings", EmbedShape(kind, body, body["model"]))


@bp.post("/api/embed")
def embed():
    """Embeddings of one input or many (batched by the model's runner), L2-normalised."""
    return _embedding("embed")


@bp.post("/api/embeddings")
def embeddings():
    """The older single-prompt embeddings endpoint."""
    return _embedding("embeddings")


def _may_manage() -> None:
    _authenticate()
    if not services().settings.get("api_manage_models"):
        raise ApiError(403, "changing the models folder through the API is off; the household's admin can turn on "
                            "the setting api_manage_models, or pull and delete on the dashboard's Models page",
                       code="manage_models_off", err_type="permission_error")


def pull_lines(p) -> Iterator[dict]:
    """A pull's progress as Ollama's NDJSON statuses, until it ends (success or an error line)."""
    yield {"status": "pulling manifest"}
    while p.state == "resolving":
        time.sleep(PULL_POLL_S)
    while p.state == "downloading":
        digest = f"sha256:{p.sha256}" if p.sha256 else ""
        yield {"status": f"pulling {p.filename}", "digest": digest, "total": p.total_bytes or 0,
               "completed": p.done_bytes}
        time.sleep(PULL_POLL_S)
    while p.state == "verifying":
        time.sleep(PULL_POLL_S)
    if p.state != "done":
        yield {"error": p.error or f"the pull {p.state}"}
        return
    yield {"status": f"pulling {p.filename}", "digest": f"sha256:{p.sha256}", "total": p.total_bytes or p.done_bytes,
           "completed": p.done_bytes}
    yield {"status": "verifying sha256 digest"}
    yield {"status": "writing manifest"}
    yield {"status": "success"}


@bp.post("/api/pull")
def pull():
    """Pull a GGUF (hf.co/owner/repo:QUANT, owner/repo/file.gguf or a URL) into the models folder, with progress."""
    _may_manage()
    body = _json_body()
    p = services().library.start(_model_field(body))
    if body.get("stream") is not False:
        # The pull runs on its own thread; this response only reports on it, so a client that
        # goes away leaves the download going (the dashboard shows it).
        return Response(stream_with_context(_ndjson(line) for line in pull_lines(p)), mimetype=NDJSON)
    lines = list(pull_lines(p))
    if "error" in lines[-1]:
        status = 507 if "disk" in lines[-1]["error"] else 409 if p.state == "refused" else 502
        raise ApiError(status, lines[-1]["error"], code="pull_" + p.state)
    return lines[-1]


@bp.delete("/api/delete")
def delete():
    """Delete a model file (refused while it serves, and for the embedded default model)."""
    _may_manage()
    services().router.delete_model(_catalog_name(_model_field(_json_body())))
    return {}


@bp.post("/api/copy")
def copy():
    """Ollama's copy, as Hearth's alias: the destination name becomes another name of the source."""
    _may_manage()
    body = _json_body()
    source = _catalog_name(body.get("source") or "")
    destination = body.get("destination")
    if not isinstance(destination, str) or not destination:
        raise ApiError(400, "'destination' is required", param="destination")
    alias = destination.removesuffix(f":{DEFAULT_TAG}")
    h = services()
    if alias in h.catalog.model_specs() or h.catalog.aliases().get(alias, source) != source:
        raise ApiError(409, f"'{destination}' already names another model", param="destination")
    with h.sessions() as s:
        row = s.scalar(select(db.Model).where(db.Model.name == source))
        row.alias = alias
        s.commit()
    h.catalog.rescan()
    return {}


@bp.post("/api/create")
def create():
    """Refused: Hearth serves GGUF files as they are, it builds no models from Modelfiles."""
    raise ApiError(501, "Hearth does not create models from Modelfiles: put a .gguf into the models folder, or pull "
                        "one (`hearth models pull`, the dashboard's Models page, /api/pull)", code="not_supported")


@bp.post("/api/push")
def push():
    """Refused: Hearth pushes to no registry."""
    raise ApiError(501, "Hearth does not push models to a registry", code="not_supported")

