"""The runner's HTTP surface (llama-server's protocol) as a plain WSGI app on werkzeug.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /health, /slots, /metrics,
/props, /v1/models. Errors use OpenAI's shape. No Flask here: the engine package stays free
of the web app.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import select
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge
from werkzeug.routing import Map, Rule
from werkzeug.wrappers import Request as HttpRequest
from werkzeug.wrappers import Response

from app.engine import tools as toolfmt
from app.engine.api import (
    MAX_BODY_BYTES,
    ApiError,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    EmbeddingBody,
    InfillBody,
    TokenizeBody,
    parse_body,
    too_large,
)
from app.engine.chat import ChatTemplate, ChatTemplateError, fallback_template, strip_leading_bos, template_for
from app.engine.engine import Engine
from app.engine.grammar import Grammar, UnsupportedSchema, json_object_grammar, schema_grammar
from app.engine.model_config import ModelConfig
from app.engine.request import ContextOverflow, Delta, Finished, QueueFull, Request
from app.policy import SLO_HEADER, Mode, parse_slo_header

log = logging.getLogger(__name__)

CLIENT_CHECK_S = 0.2  # how often a waiting request looks whether its client is still there


@dataclass(frozen=True)
class RunnerConfig:
    """Everything `hearth runner` was started with."""

    model: ModelConfig
    mode: str = Mode.CONTINUOUS.value
    token_budget: int | None = None
    max_waiting: int = 64
    default_max_tokens: int = 512
    alias: str | None = None
    prefix_cache: bool = True

    @property
    def model_name(self) -> str:
        """The name clients see in responses."""
        return self.alias or Path(self.model.path).name


class RunnerState:
    """The model and engine behind the HTTP app; loads in the background so /health answers at once."""

    def __init__(self, config: RunnerConfig):
        self.config = config
        self.status = "loading"
        self.error: str | None = None
        self.model = None
        self.engine: Engine | None = None
        self.metrics = None
        self.template: ChatTemplate | None = None
        self.tool_format = toolfmt.GENERIC
        self.tool_trigger_tokens: tuple[int, ...] = ()
        self.load_s: float | None = None
        self._embedder = None
        self._embedder_lock = threading.Lock()

    def embedder(self):
        """The embedding context on the loaded model, made on first use (a runner that never embeds never pays for it)."""
        with self._embedder_lock:
            if self._embedder is None:
                from app.engine.embeddings import EmbeddingContext

                self._embedder = EmbeddingContext(self.model, self.config.model.n_threads)
            return self._embedder

    def load(self) -> None:
        """Load the model, create the engine and start its thread; records any failure for /health."""
        from app.engine.llama_model import LlamaModel
        from app.engine.metrics import RunnerMetrics

        t0 = time.monotonic()
        cfg = self.config
        try:
            self.model = LlamaModel(cfg.model)
            # The GGUF's own template; else a built-in one for its architecture; else ChatML.
            # Read through llama.cpp, which has the metadata loaded already.
            m = self.model
            bos, eos = m.token_text(m.bos_token), m.token_text(m.eos_token)
            self.template = template_for(m.chat_template(), m.architecture, bos, eos) or fallback_template(bos, eos)
            self.tool_format = toolfmt.detect_format(self.template.source)
            if self.tool_format == toolfmt.MISTRAL:
                marker = m.tokenize(toolfmt.MISTRAL_MARK, add_special=False, parse_special=True)
                self.tool_trigger_tokens = tuple(marker) if len(marker) == 1 else ()
            self.engine = Engine(
                self.model, mode=cfg.mode, token_budget=cfg.token_budget, max_waiting=cfg.max_waiting,
                prefix_cache=cfg.prefix_cache,
            ).start()
            self.metrics = RunnerMetrics(self.engine)
            self.load_s = time.monotonic() - t0
            self.status = "ok"
            log.info("model %s loaded in %.2f s", cfg.model.path, self.load_s)
        except Exception as exc:
            log.exception("loading %s failed", cfg.model.path)
            self.error = str(exc)
            self.status = "error"

    def start_loading(self) -> threading.Thread:
        """Load in a background thread."""
        t = threading.Thread(target=self.load, name="hearth-load", daemon=True)
        t.start()
        return t


def _client_gone(environ) -> bool:
    """True when the client closed its connection (checked without consuming data)."""
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _json(data, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(data, ensure_ascii=False), status=status, headers=headers, mimetype="application/json")


def _error(err: ApiError) -> Response:
    return _json(err.body(), err.status, err.headers)


class RunnerApp:
    """WSGI callable for one runner."""

    def __init__(self, state: RunnerState):
        self.state = state
        self.url_map = Map(
            [
                Rule("/health", endpoint="health", methods=["GET"]),
                Rule("/slots", endpoint="slots", methods=["GET"]),
                Rule("/metrics", endpoint="metrics", methods=["GET"]),
                Rule("/props", endpoint="props", methods=["GET"]),
                Rule("/v1/models", endpoint="models", methods=["GET"]),
                Rule("/tokenize", endpoint="tokenize", methods=["POST"]),
                Rule("/detokenize", endpoint="detokenize", methods=["POST"]),
                Rule("/v1/completions", endpoint="completions", methods=["POST"]),
                Rule("/completions", endpoint="completions", methods=["POST"]),
                Rule("/infill", endpoint="infill", methods=["POST"]),
                Rule("/v1/chat/completions", endpoint="chat", methods=["POST"]),
                Rule("/chat/completions", endpoint="chat", methods=["POST"]),
                Rule("/v1/embeddings", endpoint="embeddings", methods=["POST"]),
                Rule("/embeddings", endpoint="embeddings", methods=["POST"]),
            ]
        )

    def __call__(self, environ, start_response):
        req = HttpRequest(environ)
        req.max_content_length = MAX_BODY_BYTES
        try:
            endpoint, _ = self.url_map.bind_to_environ(environ).match()
            resp = getattr(self, f"on_{endpoint}")(req)
        except ApiError as err:
            resp = _error(err)
        except HTTPException as exc:
            resp = _error(ApiError(exc.code or 500, exc.description or exc.name, err_type="invalid_request_error"))
        except Exception as exc:  # one bad request must never take the runner down
            log.exception("unhandled error on %s", req.path)
            resp = _error(ApiError(500, f"internal error: {exc}", err_type="server_error"))
        return resp(environ, start_response)

    # -- state endpoints -----------------------------------------------------------------------

    def _ready(self) -> Engine:
        s = self.state
        if s.status == "loading":
            raise ApiError(503, "the model is still loading; retry shortly", code="loading",
                           err_type="unavailable_error", headers={"Retry-After": "1"})
        if s.status == "error":
            raise ApiError(500, f"the model failed to load: {s.error}", code="load_failed", err_type="server_error")
        assert s.engine is not None
        return s.engine

    def on_health(self, req):
        s = self.state
        if s.status == "ok":
            snap = s.engine.snapshot()
            return _json({"status": "ok", "slots_idle": snap.n_seq_max - snap.num_running,
                          "slots_processing": snap.num_running, "requests_waiting": snap.num_waiting})
        if s.status == "loading":
            return _json({"status": "loading", "error": {"code": 503, "message": "Loading model"}}, 503)
        return _json({"status": "error", "error": {"code": 500, "message": s.error}}, 500)

    def on_slots(self, req):
        return _json(self._ready().snapshot().slots)

    def on_metrics(self, req):
        self._ready()
        return Response(self.state.metrics.render(), mimetype="text/plain; version=0.0.4")

    def on_props(self, req):
        engine = self._ready()
        snap = engine.snapshot()
        return _json({
            "model_path": self.state.config.model.path,
            "model_alias": self.state.config.model_name,
            "total_slots": snap.n_seq_max,
            "mode": snap.mode,
            "token_budget": snap.token_budget,
            "load_s": self.state.load_s,
            "kv_cache_bytes": self.state.model.kv_cache_bytes(),
            "model": self.state.model.describe(),
            "chat_template": self.state.template.source if self.state.template else None,
            "tool_format": self.state.tool_format,
            "fim_tokens": sorted(self.state.model.fim_tokens()),
            "prefix_cache": {
                "enabled": snap.prefix_cache,
                "note": snap.prefix_cache_note,
                "n_swa": self.state.model.n_swa,
                "entries": snap.prefix_cache_entries,
                "max_entries": engine.scheduler.cache.max_entries,
                "kv_cells_cached": snap.kv_cached,
            },
        })

    def on_models(self, req):
        return _json({"object": "list", "data": [
            {"id": self.state.config.model_name, "object": "model", "owned_by": "hearth", "created": 0}
        ]})

    def on_tokenize(self, req):
        body = self._parse(req, TokenizeBody)
        self._ready()
        tokens = self.state.model.tokenize(body.content, add_special=body.add_special, parse_special=True)
        return _json({"tokens": tokens})

    def on_detokenize(self, req):
        body = self._parse(req, DetokenizeBody)
        self._ready()
        model = self.state.model
        bad = next((t for t in body.tokens if t >= model.n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"'tokens': token id {bad} is outside the vocabulary (0..{model.n_vocab - 1})",
                           param="tokens")
        raw = b"".join(model.token_bytes(t) for t in body.tokens)
        return _json({"content": raw.decode("utf-8", "replace")})

    def on_embeddings(self, req):
        body = self._parse(req, EmbeddingBody)
        self._ready()
        model = self.state.model
        inputs = []
        for i, item in enumerate(body.inputs()):
            if isinstance(item, str):
                inputs.append(model.tokenize(item, add_special=True, parse_special=False))
                continue
            bad = next((t for t in item if t >= model.n_vocab), None)
            if bad is not None:
                raise ApiError(400, f"'input.{i}': token id {bad} is outside the vocabulary (0..{model.n_vocab - 1})",
                               param="input")
            inputs.append(item)
        embedder = self.state.embedder()
        if body.dimensions is not None and body.dimensions > embedder.n_embd:
            raise ApiError(400, f"'dimensions': {body.dimensions} is more than the model's {embedder.n_embd}",
                           param="dimensions")
        from app.engine.embeddings import InputTooLong, normalise

        t0 = time.monotonic()
        try:
            result = embedder.embed(inputs, truncate=body.truncate)
        except InputTooLong as exc:
            raise ApiError(400, str(exc), param="input", code="context_length_exceeded")
        data = []
        for i, vec in enumerate(result.vectors):
            if body.dimensions is not None:
                # Shortened as Matryoshka-trained models mean it: the leading dimensions, renormalised.
                vec = normalise(vec[: body.dimensions])
            if body.encoding_format == "base64":
                value = base64.b64encode(vec.astype("<f4").tobytes()).decode()
            else:
                value = vec.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        return _json({
            "object": "list", "data": data, "model": self.state.config.model_name,
            "usage": {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens},
            "timings": {"total_ms": (time.monotonic() - t0) * 1000, "num_decodes": result.num_decodes,
                        "pooling": embedder.pooling},
        })

    # -- generation --------------------------------------------------------------------------------

    def _parse(self, req: HttpRequest, schema: type[BaseModel]):
        try:
            raw = req.get_data(cache=False)
        except RequestEntityTooLarge:
            raise too_large()
        return parse_body(raw, schema)[0]

    def on_completions(self, req):
        body = self._parse(req, CompletionBody)
        engine = self._ready()
        model = self.state.model
        if body.fim:
            if not isinstance(body.prompt, str):
                raise ApiError(400, "'prompt': with 'suffix', the prompt must be text", param="prompt")
            tokens = self._fim_tokens(body.prompt, body.suffix, [], "", "suffix")
        elif isinstance(body.prompt, str):
            tokens = model.tokenize(body.prompt, add_special=True, parse_special=True)
        else:
            bad = next((t for t in body.prompt if t >= model.n_vocab), None)
            if bad is not None:
                raise ApiError(400, f"'prompt': token id {bad} is outside the vocabulary (0..{model.n_vocab - 1})",
                               param="prompt")
            tokens = list(body.prompt)
        return self._generate(req, engine, body, tokens, chat=False, logprobs=body.logprobs)

    def on_infill(self, req):
        body = self._parse(req, InfillBody)
        engine = self._ready()
        tokens = self._fim_tokens(body.input_prefix, body.input_suffix, body.input_extra, body.prompt, "input_suffix")
        return self._generate(req, engine, body, tokens, chat=False, infill=True)

    def _fim_tokens(self, prefix: str | None, suffix: str, extra: list, after: str, param: str) -> list[int]:
        """A fill-in-the-middle prompt in the model's own FIM tokens (prefix, suffix, middle)."""
        model = self.state.model
        fim = model.fim_tokens()
        missing = [k for k in ("pre", "suf", "mid") if k not in fim]
        if missing:
            raise ApiError(400, f"'{param}': this model has no fill-in-the-middle tokens in its vocabulary "
                                f"(missing: {', '.join('FIM ' + k for k in missing)}); use a code model that has them",
                           param=param, code="fim_unsupported")

        def text(t: str) -> list[int]:
            return model.tokenize(t, add_special=False, parse_special=False) if t else []

        tokens = [model.bos_token] if model.add_bos else []
        for chunk in extra:
            # Other files as repository context, the way llama-server lays out input_extra.
            if "sep" in fim:
                tokens += [fim["sep"]] + text(f"{chunk.filename}\n{chunk.text}")
            else:
                tokens += text(f"// {chunk.filename}\n{chunk.text}\n")
        tokens += [fim["pre"]] + text(prefix or "") + [fim["suf"]] + text(suffix) + [fim["mid"]] + text(after)
        return tokens

    def on_chat(self, req):
        body = self._parse(req, ChatBody)
        engine = self._ready()
        state = self.state
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tools = body.tool_list
        fmt = state.tool_format
        messages = toolfmt.prepare_messages(messages, fmt, tools, body.choice, body.parallel_tool_calls)
        native_tools = tools if tools and fmt != toolfmt.GENERIC else None
        try:
            text = state.template.render(messages, add_generation_prompt=True, tools=native_tools)
        except ChatTemplateError as exc:
            raise ApiError(400, f"'messages': {exc}", param="messages", code="chat_template")
        text, _ = strip_leading_bos(text, state.template.bos_token)
        tokens = state.model.tokenize(text, add_special=True, parse_special=True)
        try:
            grammar = self._chat_grammar(body, tools, fmt)
        except UnsupportedSchema as exc:
            param = "tools" if tools else "response_format"
            raise ApiError(400, f"'{param}': {exc}", param=param, code="unsupported_schema")
        top = (body.top_logprobs or 0) if body.logprobs else None
        return self._generate(req, engine, body, tokens, chat=True, grammar=grammar, logprobs=top,
                              tools=tools if tools else None)

    def _chat_grammar(self, body: ChatBody, tools: list[dict], fmt: str) -> Grammar | None:
        """The constraint of a chat request: a forced call, else the response format, else a lazy call grammar."""
        forced = tools and (body.choice == "required" or isinstance(body.choice, dict))
        calls = toolfmt.call_grammar(tools, fmt, body.choice, body.parallel_tool_calls,
                                     self.state.tool_trigger_tokens) if tools else None
        if forced:
            return calls
        rf = body.response_format
        if rf is not None and rf.type == "json_object":
            return json_object_grammar()
        if rf is not None and rf.type == "json_schema":
            return schema_grammar(rf.json_schema.schema_)
        return calls

    def _generate(self, req: HttpRequest, engine: Engine, body, tokens: list[int], chat: bool,
                  grammar: Grammar | None = None, logprobs: int | None = None, tools: list[dict] | None = None,
                  infill: bool = False):
        arrival_s = time.monotonic()
        params = body.sampling(self.state.config.default_max_tokens)
        if grammar is not None or logprobs is not None:
            params = dataclasses.replace(params, grammar=grammar, logprobs=logprobs)
        try:
            request = engine.submit(
                tokens,
                params,
                priority=body.priority,
                class_name=body.hearth_class,
                arrival_s=arrival_s,
                cache_prompt=body.cache_prompt,
                slo=parse_slo_header(req.headers.get(SLO_HEADER)),
            )
        except ContextOverflow as exc:
            raise ApiError(400, str(exc), param="messages" if chat else "prompt", code="context_length_exceeded")
        except QueueFull as exc:
            raise ApiError(503, str(exc), code="queue_full", err_type="unavailable_error",
                           headers={"Retry-After": str(exc.retry_after_s)})
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        answer = _Answer(chat=chat, tools=tools, fmt=self.state.tool_format, infill=infill,
                         logprobs=logprobs is not None)
        if body.stream:
            return Response(
                self._stream(req.environ, engine, request, body, rid, answer),
                mimetype="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return self._complete(req.environ, engine, request, rid, answer)

    def _events(self, environ, engine: Engine, request: Request) -> Iterator[Delta | Finished]:
        """The request's events; cancels it when the client goes away."""
        done = False
        next_check_s = time.monotonic() + CLIENT_CHECK_S
        try:
            for ev in engine.events(request, poll_s=CLIENT_CHECK_S):
                # Tokens may arrive faster than the poll interval, so check by the clock, not on idle.
                if time.monotonic() >= next_check_s:
                    next_check_s = time.monotonic() + CLIENT_CHECK_S
                    if _client_gone(environ):
                        log.info("client went away; cancelling request %s", request.request_id)
                        return
                if ev is None:
                    continue
                if isinstance(ev, Finished):
                    done = True
                yield ev
        finally:
            if not done:
                engine.cancel(request)

    def _usage(self, fin: Finished) -> dict:
        s = fin.stats
        return {
            "prompt_tokens": s.num_prompt_tokens,
            "completion_tokens": s.num_completion_tokens,
            "total_tokens": s.num_prompt_tokens + s.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": s.num_cached_tokens},
        }

    def _timings(self, fin: Finished) -> dict:
        # llama-server's names for the prompt tokens reused and computed, beside Hearth's own.
        s = fin.stats
        return {**s.as_dict(), "cache_n": s.num_cached_tokens, "prompt_n": s.num_prompt_tokens - s.num_cached_tokens}

    def _complete(self, environ, engine, request, rid, answer: _Answer) -> Response:
        parts: list[str] = []
        logprobs: list[dict] = []
        fin: Finished | None = None
        for ev in self._events(environ, engine, request):
            if isinstance(ev, Delta):
                parts.append(ev.text)
                if ev.logprob is not None:
                    logprobs.append(ev.logprob)
            else:
                fin = ev
        if fin is None:  # client gone: nobody reads this, but answer sanely
            return _error(ApiError(499, "client closed the connection", code="client_closed"))
        if fin.error:
            status = 503 if fin.finish_reason == "cancelled" else 500
            return _error(ApiError(status, fin.error, code="generation_failed", err_type="server_error"))
        text = "".join(parts)
        created = int(time.time())
        model_name = self.state.config.model_name
        if answer.infill:
            return _json({"content": text, "stop": True, "model": model_name, "id_slot": request.slot,
                          "tokens_predicted": fin.stats.num_completion_tokens,
                          "tokens_evaluated": fin.stats.num_prompt_tokens,
                          "stop_type": "limit" if fin.finish_reason == "length" else "eos",
                          "usage": self._usage(fin), "timings": self._timings(fin)})
        finish = fin.finish_reason
        if answer.chat:
            message: dict = {"role": "assistant", "content": text}
            if answer.tools:
                parsed = toolfmt.parse(text, answer.fmt, answer.tools)
                if parsed.calls:
                    message["content"] = parsed.content.strip() or None
                    message["tool_calls"] = [c.as_openai() for c in parsed.calls]
                    finish = "tool_calls"
            choice = {"index": 0, "message": message,
                      "logprobs": {"content": logprobs} if answer.logprobs else None, "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": _completion_logprobs(logprobs) if answer.logprobs else None,
                      "finish_reason": finish}
            obj = "text_completion"
        return _json({
            "id": rid, "object": obj, "created": created, "model": model_name,
            "choices": [choice], "usage": self._usage(fin), "timings": self._timings(fin),
        })

    def _stream(self, environ, engine, request, body, rid, answer: _Answer) -> Iterator[bytes]:
        created = int(time.time())
        model_name = self.state.config.model_name
        chat = answer.chat
        obj = "chat.completion.chunk" if chat else "text_completion"

        def sse(payload: dict) -> bytes:
            return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"

        def chunk(delta_text: str | None, finish: str | None, role: bool = False, extra: dict | None = None,
                  logprobs: list[dict] | None = None, tool_calls: list[dict] | None = None) -> bytes:
            if answer.infill:
                payload = {"content": delta_text or "", "stop": finish is not None, "model": model_name}
                if finish is not None:
                    payload["stop_type"] = "limit" if finish == "length" else "eos"
            elif chat:
                delta = {}
                if role:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                if tool_calls is not None:
                    delta["tool_calls"] = tool_calls
                lp = {"content": logprobs} if logprobs else None
                choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
                payload = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}
            else:
                choice = {"index": 0, "text": delta_text or "",
                          "logprobs": _completion_logprobs(logprobs) if logprobs else None, "finish_reason": finish}
                payload = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}
            if extra:
                payload.update(extra)
            return sse(payload)

        calls = toolfmt.ToolStream(answer.fmt, answer.tools) if chat and answer.tools else None
        pending: list[dict] = []  # logprobs of tokens whose text is still held back
        if chat:
            yield chunk("", None, role=True)
        for ev in self._events(environ, engine, request):
            if isinstance(ev, Delta):
                if ev.logprob is not None:
                    pending.append(ev.logprob)
                text = calls.push(ev.text) if calls is not None else ev.text
                if text:
                    yield chunk(text, None, logprobs=pending)
                    pending = []
                continue
            if ev.error:
                err = ApiError(503 if ev.finish_reason == "cancelled" else 500, ev.error,
                               code="generation_failed", err_type="server_error")
                yield sse(err.body())
            else:
                finish = ev.finish_reason
                if calls is not None:
                    parsed = calls.finish()
                    if parsed.content.strip() or (pending and parsed.content):
                        yield chunk(parsed.content, None, logprobs=pending)
                        pending = []
                    for i, call in enumerate(parsed.calls):
                        # OpenAI's shape: id, type and name in a call's first delta, arguments after.
                        yield chunk(None, None, tool_calls=[{"index": i, "id": call.id, "type": "function",
                                                             "function": {"name": call.name, "arguments": ""}}])
                        yield chunk(None, None, tool_calls=[{"index": i, "function": {"arguments": call.arguments}}])
                    if parsed.calls:
                        finish = "tool_calls"
                usage = self._usage(ev)
                yield chunk(None if chat else "", finish, extra={"usage": usage, "timings": self._timings(ev)},
                            logprobs=pending or None)
                if body.include_usage and not answer.infill:
                    payload = {"id": rid, "object": obj, "created": created, "model": model_name,
                               "choices": [], "usage": usage}
                    yield sse(payload)
            if not answer.infill:
                yield b"data: [DONE]\n\n"


@dataclass(frozen=True)
class _Answer:
    """How a request's answer is shaped: chat or text, tool-call parsing, infill, logprobs."""

    chat: bool
    tools: list[dict] | None = None
    fmt: str = toolfmt.GENERIC
    infill: bool = False
    logprobs: bool = False


def _completion_logprobs(entries: list[dict]) -> dict:
    """The legacy completions logprobs object from per-token entries."""
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def create_app(config: RunnerConfig, load: bool = True) -> RunnerApp:
    """The WSGI app for one runner; starts loading the model in the background."""
    state = RunnerState(config)
    if load:
        state.start_loading()
    return RunnerApp(state)
