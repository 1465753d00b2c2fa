"""The runner's HTTP surface (llama-server's protocol) as a plain WSGI app on werkzeug.

The endpoints are the ROUTES table below, with and without /v1 as llama-server serves them:
OpenAI's chat and text completions, llama-server's native /completion, /infill, /apply-template,
/tokenize, /detokenize, /props, /slots, /metrics, /health. Around every route, as llama-server:
CORS headers and OPTIONS preflight, the API key (--api-key; /health stays public), a JSON 404.
Errors use OpenAI's shape with llama-server's `type`. No Flask here: the engine package stays
free of the web app.
"""

from __future__ import annotations

import base64
import dataclasses
import hmac
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound, RequestEntityTooLarge
from werkzeug.routing import Map, Rule
from werkzeug.wrappers import Request as HttpRequest
from werkzeug.wrappers import Response

from app.engine import tools as toolfmt
from app.engine.chat import ChatTemplate, ChatTemplateError, fallback_template, strip_leading_bos, template_for
from app.engine.engine import Engine
from app.engine.grammar import Grammar, UnsupportedSchema, json_object_grammar, schema_grammar
from app.engine.model_config import ModelConfig
from app.engine.named_template import NamedTemplate, is_template_name
from app.engine.request import ContextOverflow, Delta, Finished, Progress, QueueFull, Request, SamplingParams
from app.policy import SLO_HEADER, Mode, parse_slo_header
from app.protocols.openai import (
    MAX_BODY_BYTES,
    ApiError,
    ApplyTemplateBody,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    EmbeddingBody,
    InfillBody,
    NativeCompletionBody,
    TokenizeBody,
    parse_body,
    too_large,
)
from app.runner import compat
from app.sockets import client_gone

log = logging.getLogger(__name__)

CLIENT_CHECK_S = 0.2  # how often a waiting request looks whether its client is still there

# OpenAI's system_fingerprint; llama-server puts its build ("b<number>-<commit>") there.
SYSTEM_FINGERPRINT = "b0-hearth"
# Reachable without the API key, as in llama-server (a supervisor polls them).
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
PROCESS_START_S = int(time.time())

# A route's handler: the name of a RunnerApp method `on_<name>`, or a function handler(app, request)
# from another module of the engine package (one line here registers it).
Handler = str | Callable[["RunnerApp", HttpRequest], Response]

# (path, handler, methods). llama-server serves most routes with and without /v1.
ROUTES: list[tuple[str, Handler, tuple[str, ...]]] = [
    ("/health", "health", ("GET",)),
    ("/v1/health", "health", ("GET",)),
    ("/slots", "slots", ("GET",)),
    ("/metrics", "metrics", ("GET",)),
    ("/props", "props", ("GET",)),
    ("/models", "models", ("GET",)),
    ("/v1/models", "models", ("GET",)),
    ("/tokenize", "tokenize", ("POST",)),
    ("/detokenize", "detokenize", ("POST",)),
    ("/apply-template", "apply_template", ("POST",)),
    ("/completion", "native_completion", ("POST",)),
    ("/completions", "native_completion", ("POST",)),
    ("/v1/completions", "completions", ("POST",)),
    ("/infill", "infill", ("POST",)),
    ("/chat/completions", "chat", ("POST",)),
    ("/v1/chat/completions", "chat", ("POST",)),
    ("/chat/completions/input_tokens", "chat_input_tokens", ("POST",)),
    ("/v1/chat/completions/input_tokens", "chat_input_tokens", ("POST",)),
    ("/embedding", "embeddings", ("POST",)),
    ("/embeddings", "embeddings", ("POST",)),
    ("/v1/embeddings", "embeddings", ("POST",)),
]


@dataclass(frozen=True)
class RunnerConfig:
    """Everything `hearth runner` was started with."""

    model: ModelConfig
    mode: str = Mode.CONTINUOUS.value
    token_budget: int | None = None
    max_waiting: int = 64
    # Tokens generated when a request names no limit (None: until the context is full, llama-server's -n -1).
    default_max_tokens: int | None = 512
    alias: str | None = None
    prefix_cache: bool = True
    # Sampling defaults for requests that name none (llama-server's --temp, --seed).
    default_temperature: float | None = None
    default_seed: int | None = None
    # Clients must send one of these as a bearer token or X-Api-Key (empty: no key asked).
    api_keys: tuple[str, ...] = ()
    metrics: bool = True
    slots: bool = True
    # Jinja text that replaces the model's own chat template.
    chat_template: str | None = None
    # Embedding and reranking modes (llama-server's --embedding, --pooling, --reranking).
    embedding: bool = False
    pooling: str | None = None
    reranking: bool = False
    # llama-server's --cors-origins: "*" echoes any Origin (with credentials), "localhost" loopback ones only.
    cors_origins: str = "*"
    # llama-server's --verbose: chat answers carry `__verbose` with the rendered prompt.
    verbose: bool = False
    # llama-server's --reasoning: "on"/"off" set the templates' enable_thinking; "auto" leaves it to them.
    reasoning: str = "auto"
    # llama-server's --tags: listed on /models.
    tags: tuple[str, ...] = ()

    @property
    def model_name(self) -> str:
        """The name clients see in responses (of several comma-separated aliases, the first in order, as llama-server)."""
        return min(self.aliases) if self.aliases else Path(self.model.path).name

    @property
    def aliases(self) -> list[str]:
        """The names given with --alias (llama-server takes several, comma-separated)."""
        return [a.strip() for a in (self.alias or "").split(",") if a.strip()]


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

                self._embedder = EmbeddingContext(self.model, self.config.model.n_threads, pooling=self.config.pooling)
            return self._embedder

    def load(self) -> None:
        """Load the model, create the engine and start its thread; records any failure for /health."""
        from app.engine.llama_model import LlamaModel
        from app.runner.metrics import RunnerMetrics

        t0 = time.monotonic()
        cfg = self.config
        try:
            self.model = LlamaModel(cfg.model)
            # The GGUF's own template; else a built-in one for its architecture; else ChatML.
            # Read through llama.cpp, which has the metadata loaded already.
            m = self.model
            bos, eos = m.token_text(m.bos_token), m.token_text(m.eos_token)
            if cfg.chat_template and is_template_name(cfg.chat_template):
                self.template = NamedTemplate(cfg.chat_template, bos, eos)
            elif cfg.chat_template:
                self.template = ChatTemplate(cfg.chat_template, bos, eos, origin="command line")
            else:
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



def _json(data, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(data, ensure_ascii=False), status=status, headers=headers, mimetype="application/json")


def _error(err: ApiError) -> Response:
    return _json(err.body(), err.status, err.headers)


def not_found() -> Response:
    """llama-server's answer to a path it does not serve."""
    return _json({"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}, 404)


def not_supported(message: str) -> ApiError:
    """llama-server's 501 for an endpoint switched off by a flag."""
    return ApiError(501, message, code="not_supported", err_type="not_supported_error")


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
        self.url_map = Map([Rule(path, endpoint=path, methods=list(methods)) for path, _, methods in ROUTES])
        self.handlers: dict[str, Handler] = {path: handler for path, handler, _ in ROUTES}
        compat.install(self, self.url_map)

    def __call__(self, environ, start_response):
        req = HttpRequest(environ)
        req.max_content_length = MAX_BODY_BYTES
        if req.method == "OPTIONS":
            # A browser's preflight carries no credentials: answered before the key check, as llama-server.
            resp = Response("", 200, mimetype="text/html")
            resp.headers["Access-Control-Allow-Credentials"] = "true"
            resp.headers["Access-Control-Allow-Methods"] = CORS_METHODS
            resp.headers["Access-Control-Allow-Headers"] = "*"
        else:
            resp = self._dispatch(req)
        self._cors(req, resp)
        return resp(environ, start_response)

    def _dispatch(self, req: HttpRequest) -> Response:
        try:
            if req.path not in PUBLIC_PATHS:
                self._check_key(req)
            endpoint, _ = self.url_map.bind_to_environ(req.environ).match()
            if callable(endpoint):  # routes added by app.runner.compat carry their handler as the endpoint
                return endpoint(req)
            handler = self.handlers[endpoint]
            return getattr(self, f"on_{handler}")(req) if isinstance(handler, str) else handler(self, req)
        except ApiError as err:
            return _error(err)
        except NotFound:
            return not_found()
        except MethodNotAllowed as exc:
            return _error(ApiError(405, f"{req.method} is not allowed on {req.path}", code="method_not_allowed",
                                   headers={"Allow": ", ".join(exc.valid_methods or ())}))
        except HTTPException as exc:
            return _error(ApiError(exc.code or 500, exc.description or exc.name, err_type="invalid_request_error"))
        except Exception as exc:  # one bad request must never take the runner down
            log.exception("unhandled error on %s", req.path)
            return _error(ApiError(500, f"internal error: {exc}", err_type="server_error"))

    def _check_key(self, req: HttpRequest) -> None:
        keys = self.state.config.api_keys
        if not keys:
            return
        given = req.headers.get("Authorization") or req.headers.get("X-Api-Key") or ""
        if given.startswith("Bearer "):
            given = given[len("Bearer "):]
        if not any(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
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
        if not self.state.config.slots:
            raise not_supported("This server does not support slots endpoint. Start it with `--slots`")
        engine = self._ready()
        n_ctx = self.state.model.n_ctx
        # llama-server's fields (id, n_ctx, is_processing, id_task) beside Hearth's own.
        return _json([{**slot, "n_ctx": n_ctx, "id_task": slot["request_id"] if slot["is_processing"] else -1}
                      for slot in engine.snapshot().slots])

    def on_metrics(self, req):
        if not self.state.config.metrics:
            raise not_supported("This server does not support metrics endpoint. Start it with `--metrics`")
        self._ready()
        return Response(self.state.metrics.render(), mimetype="text/plain; version=0.0.4",
                        headers={"Process-Start-Time-Unix": str(PROCESS_START_S)})

    def generation_settings(self, params: SamplingParams | None, n_probs: int = 0, stream: bool = False) -> dict:
        """llama-server's `generation_settings` of a request (None: the runner's defaults)."""
        cfg = self.state.config
        if params is None:
            limit = cfg.default_max_tokens
            params = SamplingParams(max_tokens=limit or -1,
                                    temperature=0.8 if cfg.default_temperature is None else cfg.default_temperature,
                                    seed=cfg.default_seed)
        return {
            "seed": params.seed if params.seed is not None else 0xFFFFFFFF,
            "temperature": params.temperature, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
            "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p, "top_n_sigma": -1.0,
            "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0,
            "repeat_last_n": params.repeat_last_n, "repeat_penalty": params.repeat_penalty,
            "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
            "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
            "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": -1.0, "adaptive_decay": 0.9,
            "max_tokens": params.max_tokens, "n_predict": params.max_tokens, "n_keep": 0, "n_discard": 0,
            "ignore_eos": params.ignore_eos, "stream": stream, "n_probs": n_probs, "min_keep": 0,
            "stop": list(params.stop), "logit_bias": self._bias_list(params),
            "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
            "grammar": params.grammar.gbnf if params.grammar is not None else "",
            "post_sampling_probs": False, "timings_per_token": False,
        }

    def _bias_list(self, params: SamplingParams) -> list[dict]:
        """llama-server's logit_bias list: ignore_eos shows as the end-of-generation tokens at -inf (null)."""
        biases = dict(params.logit_bias)
        if params.ignore_eos:
            biases.update({t: -math.inf for t in getattr(self.state.model, "eog_tokens", ())})
        return [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in biases.items()]

    def on_props(self, req):
        engine = self._ready()
        snap = engine.snapshot()
        cfg = self.state.config
        template = self.state.template
        return _json({
            # llama-server's fields first; is_sleeping is always false (Hearth has no sleep on idle).
            "default_generation_settings": {"params": self.generation_settings(None), "n_ctx": self.state.model.n_ctx},
            "model_path": self.state.config.model.path,
            "model_alias": self.state.config.model_name,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": cfg.slots, "endpoint_props": False, "endpoint_metrics": cfg.metrics,
            "bos_token": template.bos_token if template else "", "eos_token": template.eos_token if template else "",
            "build_info": SYSTEM_FINGERPRINT, "is_sleeping": False,
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
        cfg = self.state.config
        return _json({"object": "list", "data": [
            {"id": cfg.model_name, "object": "model", "owned_by": "hearth", "created": 0,
             "aliases": cfg.aliases or [cfg.model_name], "tags": list(cfg.tags)}
        ]})

    def on_tokenize(self, req):
        body = self._parse(req, TokenizeBody)
        self._ready()
        model = self.state.model
        tokens = model.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special)
        if not body.with_pieces:
            return _json({"tokens": tokens})
        pieces = []
        for t in tokens:
            raw = model.token_bytes(t)
            try:
                piece: str | list[int] = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)  # part of a character: its bytes, as llama-server sends them
            pieces.append({"id": t, "piece": piece})
        return _json({"tokens": pieces})

    def on_apply_template(self, req):
        body = self._parse(req, ApplyTemplateBody)
        self._ready()
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []] or None
        return _json({"prompt": self._render(messages, body.add_generation_prompt, tools, body.chat_template_kwargs)})

    def on_chat_input_tokens(self, req):
        body = self._parse(req, ChatBody)
        self._ready()
        return _json({"input_tokens": len(self._chat_tokens(body)[0])})

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
                kwargs: dict | None = None) -> str:
        cfg = self.state.config
        # As llama.cpp renders templates: thinking on unless --reasoning off, today's date_string (Llama 3.x
        # templates print it); a request's own chat_template_kwargs win.
        defaults = {"enable_thinking": cfg.reasoning != "off", "date_string": time.strftime("%d %b %Y")}
        try:
            return self.state.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                              kwargs={**defaults, **(kwargs or {})})
        except ChatTemplateError as exc:
            raise ApiError(400, f"'messages': {exc}", param="messages", code="chat_template")

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
        if self.state.config.pooling == "none":
            # One vector per token has no OpenAI shape; llama-server refuses it the same way.
            raise ApiError(400, "this runner was started with --pooling none (a vector per token), which has no "
                                "embeddings answer here: start it with --pooling mean, cls or last",
                           param="input", code="pooling_not_supported")
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
        if body.fim:
            if not isinstance(body.prompt, str):
                raise ApiError(400, "'prompt': with 'suffix', the prompt must be text", param="prompt")
            tokens = self._fim_tokens(body.prompt, body.suffix, [], "", "suffix")
        else:
            tokens = self._prompt_tokens(body.prompt, "prompt")
        return self._generate(req, engine, body, tokens, _Answer(kind=TEXT, verbose=body.verbose), logprobs=body.logprobs)

    def on_native_completion(self, req):
        body = self._parse(req, NativeCompletionBody)
        engine = self._ready()
        prompts = self._native_prompts(body.prompt)
        try:
            grammar = self._native_grammar(body)
        except UnsupportedSchema as exc:
            raise ApiError(400, f"'json_schema': {exc}", param="json_schema", code="unsupported_schema")
        answer = _Answer(kind=NATIVE, return_tokens=body.return_tokens, post_sampling=body.post_sampling_probs,
                         response_fields=tuple(body.response_fields or ()))
        logprobs = body.n_probs or None
        if len(prompts) == 1:
            return self._generate(req, engine, body, prompts[0], answer, grammar=grammar, logprobs=logprobs)
        if body.stream:
            raise ApiError(400, "'prompt': several prompts cannot be streamed; send one per request", param="prompt")
        # Several prompts are submitted together, so they batch, and answered as a list in their order.
        requests = [self._submit(req, engine, body, tokens, grammar, logprobs, False) for tokens in prompts]
        results = []
        for index, (request, params) in enumerate(requests):
            resp = self._complete(req.environ, engine, request, params, "", dataclasses.replace(answer, index=index))
            if resp.status_code != 200:
                for other, _ in requests[index + 1:]:
                    engine.cancel(other)
                return resp
            results.append(json.loads(resp.get_data()))
        return _json(results)

    def on_infill(self, req):
        body = self._parse(req, InfillBody)
        engine = self._ready()
        tokens = self._fim_tokens(body.input_prefix, body.input_suffix, body.input_extra, body.prompt, "input_suffix")
        return self._generate(req, engine, body, tokens, _Answer(kind=NATIVE), logprobs=body.n_probs or None)

    def _prompt_tokens(self, prompt, param: str) -> list[int]:
        """One prompt as tokens: text (BOS added, special tokens parsed) or ids, which may mix in text."""
        model = self.state.model
        if isinstance(prompt, str):
            return model.tokenize(prompt, add_special=True, parse_special=True)
        tokens: list[int] = []
        for item in prompt:
            if isinstance(item, str):
                tokens += model.tokenize(item, add_special=False, parse_special=True)
            elif isinstance(item, int) and not isinstance(item, bool) and 0 <= item < model.n_vocab:
                tokens.append(item)
            else:
                raise ApiError(400, f"'{param}': token id {item!r} is outside the vocabulary (0..{model.n_vocab - 1})",
                               param=param)
        if not tokens:
            raise ApiError(400, f"'{param}' is empty", param=param)
        return tokens

    def _native_prompts(self, prompt) -> list[list[int]]:
        """llama-server's prompt forms: text, ids (mixed with text), a list of those, or {"prompt_string"}."""
        if isinstance(prompt, dict):
            if prompt.get("multimodal_data"):
                raise ApiError(400, "'prompt': multimodal data is not supported by this model", param="prompt",
                               code="multimodal_unsupported")
            text = prompt.get("prompt_string")
            if not isinstance(text, str):
                raise ApiError(400, "'prompt.prompt_string' must be text", param="prompt")
            return [self._prompt_tokens(text, "prompt")]
        if isinstance(prompt, str):
            return [self._prompt_tokens(prompt, "prompt")]
        if not prompt:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        if any(isinstance(p, int) for p in prompt):
            return [self._prompt_tokens(prompt, "prompt")]
        return [self._prompt_tokens(p if isinstance(p, (str, list)) else [p], "prompt") for p in prompt]

    def _native_grammar(self, body: NativeCompletionBody) -> Grammar | None:
        if body.grammar:
            return Grammar(gbnf=body.grammar, root="root", kind="grammar")
        if body.json_schema is not None:
            return schema_grammar(body.json_schema)
        return None

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

    def _chat_tokens(self, body: ChatBody) -> tuple[list[int], list[dict]]:
        """The prompt tokens of a chat request and the tools it offers."""
        state = self.state
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tools = body.tool_list
        fmt = state.tool_format
        messages = toolfmt.prepare_messages(messages, fmt, tools, body.choice, body.parallel_tool_calls)
        native_tools = tools if tools and fmt != toolfmt.GENERIC else None
        if body.prefill and not tools:
            text = self._continue_final(messages, native_tools, body.chat_template_kwargs)
        else:
            text = self._render(messages, body.add_generation_prompt, native_tools, body.chat_template_kwargs)
        text, _ = strip_leading_bos(text, state.template.bos_token)
        return state.model.tokenize(text, add_special=True, parse_special=True), tools

    def _continue_final(self, messages: list[dict], tools, kwargs) -> str:
        """The prompt that continues the final assistant message: rendered, then cut after its text."""
        content = messages[-1].get("content")
        if isinstance(content, list):
            # The continued message's text parts are joined by a blank line, as llama-server continues them.
            content = "\n\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
            messages = [*messages[:-1], {**messages[-1], "content": content}]
        text = self._render(messages, False, tools, kwargs)
        cut = text.rfind(content.rstrip()) if content and content.strip() else -1
        return text[: cut + len(content.rstrip())] if cut >= 0 else text

    def on_chat(self, req):
        body = self._parse(req, ChatBody)
        engine = self._ready()
        tokens, tools = self._chat_tokens(body)
        fmt = self.state.tool_format
        try:
            grammar = self._chat_grammar(body, tools, fmt)
        except UnsupportedSchema as exc:
            param = "tools" if tools else "response_format"
            raise ApiError(400, f"'{param}': {exc}", param=param, code="unsupported_schema")
        top = (body.top_logprobs or 0) if body.logprobs else None
        answer = _Answer(kind=CHAT, tools=tools or None, fmt=fmt, verbose=body.verbose)
        return self._generate(req, engine, body, tokens, answer, grammar=grammar, logprobs=top)

    def _chat_grammar(self, body: ChatBody, tools: list[dict], fmt: str) -> Grammar | None:
        """The constraint of a chat request: a forced call, else the response format, else a lazy call grammar."""
        forced = tools and (body.choice == "required" or isinstance(body.choice, dict))
        calls = toolfmt.call_grammar(tools, fmt, body.choice, body.parallel_tool_calls,
                                     self.state.tool_trigger_tokens) if tools else None
        if forced:
            return calls
        rf = body.response_format
        if rf is not None and rf.type == "json_object" and rf.schema_ is not None:
            return schema_grammar(rf.schema_)
        if rf is not None and rf.type == "json_object":
            return json_object_grammar()
        if rf is not None and rf.type == "json_schema":
            return schema_grammar(rf.json_schema.schema_)
        if body.grammar:
            return Grammar(gbnf=body.grammar, root="root", kind="grammar")
        if body.json_schema is not None:
            return schema_grammar(body.json_schema)
        return calls

    def _params(self, body, n_prompt: int, grammar: Grammar | None, logprobs: int | None) -> SamplingParams:
        """The engine's sampling settings of a request, with the runner's defaults (-n: a limit for requests naming none)."""
        cfg = self.state.config
        room = max(1, self.state.model.n_ctx - n_prompt)
        requested = getattr(body, "max_completion_tokens", None) or body.requested_max_tokens
        # As llama-server: a request's own limit wins over -n, which only fills in for requests naming none.
        limit = requested or cfg.default_max_tokens or room
        params = dataclasses.replace(sampling_params(body, limit), max_tokens=limit, grammar=grammar, logprobs=logprobs,
                                     logit_bias=self._logit_bias(body.logit_bias))
        given = body.model_fields_set
        if "temperature" not in given and cfg.default_temperature is not None:
            params = dataclasses.replace(params, temperature=cfg.default_temperature)
        if ("seed" not in given or body.seed == -1) and cfg.default_seed is not None:
            params = dataclasses.replace(params, seed=cfg.default_seed)
        elif body.seed == -1:
            params = dataclasses.replace(params, seed=None)
        return params

    def _logit_bias(self, raw) -> tuple[tuple[int, float], ...]:
        """logit_bias in OpenAI's ({id: bias}) or llama-server's ([[id or text, bias or false]]) form."""
        if not raw:
            return ()
        pairs = raw.items() if isinstance(raw, dict) else [tuple(p) for p in raw]
        model = self.state.model
        out: dict[int, float] = {}
        for pair in pairs:
            if len(pair) != 2:
                raise ApiError(400, "'logit_bias': each entry is [token, bias]", param="logit_bias")
            key, bias = pair
            value = -math.inf if bias is False else float(bias)
            if isinstance(key, str) and key.lstrip("-").isdigit():
                ids = [int(key)]
            elif isinstance(key, str):
                # Text: every token of it, as llama-server does.
                ids = model.tokenize(key, add_special=False, parse_special=False)
            else:
                ids = [int(key)]
            for t in ids:
                if not 0 <= t < model.n_vocab:
                    raise ApiError(400, f"'logit_bias': token id {t} is outside the vocabulary", param="logit_bias")
                out[t] = value
        return tuple(out.items())

    def _submit(self, req: HttpRequest, engine: Engine, body, tokens: list[int], grammar: Grammar | None, logprobs: int | None,
                chat: bool) -> tuple[Request, SamplingParams]:
        params = self._params(body, len(tokens), grammar, logprobs)
        try:
            request = engine.submit(
                tokens,
                params,
                priority=body.priority,
                class_name=body.hearth_class,
                arrival_s=time.monotonic(),
                cache_prompt=body.cache_prompt,
                slo=parse_slo_header(req.headers.get(SLO_HEADER)),
                return_progress=body.return_progress and body.stream,
            )
        except ContextOverflow as exc:
            raise ApiError(400, f"request ({exc.num_prompt_tokens} tokens) exceeds the available context size "
                                f"({exc.n_ctx} tokens), try increasing it",
                           param="messages" if chat else "prompt", code="context_length_exceeded",
                           err_type="exceed_context_size_error",
                           extra={"n_prompt_tokens": exc.num_prompt_tokens, "n_ctx": exc.n_ctx})
        except QueueFull as exc:
            raise ApiError(503, str(exc), code="queue_full", err_type="unavailable_error",
                           headers={"Retry-After": str(exc.retry_after_s)})
        except ValueError as exc:  # a grammar llama.cpp cannot parse
            raise ApiError(400, f"'grammar': {exc}", param="grammar", code="invalid_grammar")
        return request, params

    def _generate(self, req: HttpRequest, engine: Engine, body, tokens: list[int], answer: _Answer,
                  grammar: Grammar | None = None, logprobs: int | None = None):
        rid = ("chatcmpl-" if answer.kind == CHAT else "cmpl-") + uuid.uuid4().hex[:24]
        if logprobs is not None:
            answer = dataclasses.replace(answer, logprobs=True)
        n = getattr(body, "n", 1)
        if n > 1 and answer.kind != NATIVE:
            return self._several(req, engine, body, tokens, answer, grammar, logprobs, rid, n)
        request, params = self._submit(req, engine, body, tokens, grammar, logprobs, answer.kind == CHAT)
        if body.stream:
            return Response(
                self._stream(req.environ, engine, request, params, body, rid, answer),
                mimetype="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return self._complete(req.environ, engine, request, params, rid, answer)

    def _several(self, req, engine, body, tokens, answer, grammar, logprobs, rid, n: int) -> Response:
        """OpenAI's `n`: as many sequences of the same prompt, generated side by side, one choice each."""
        if body.stream:
            raise ApiError(400, "'n': several choices cannot be streamed; send one request per choice", param="n")
        submitted = []
        try:
            for _ in range(n):
                submitted.append(self._submit(req, engine, body, tokens, grammar, logprobs, answer.kind == CHAT))
        except ApiError:
            for request, _ in submitted:
                engine.cancel(request)
            raise
        bodies = []
        for i, (request, params) in enumerate(submitted):
            resp = self._complete(req.environ, engine, request, params, rid, answer)
            if resp.status_code != 200:
                for other, _ in submitted[i + 1:]:
                    engine.cancel(other)
                return resp
            bodies.append(json.loads(resp.get_data()))
        out = bodies[0]
        out["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
        completion = sum(b["usage"]["completion_tokens"] for b in bodies)
        out["usage"] = {**out["usage"], "completion_tokens": completion,
                        "total_tokens": out["usage"]["prompt_tokens"] + completion}
        return _json(out)

    def _events(self, environ, engine: Engine, request: Request) -> Iterator[Delta | Finished]:
        """The request's events; cancels it when the client goes away."""
        done = False
        next_check_s = time.monotonic() + CLIENT_CHECK_S
        try:
            for ev in engine.events(request, poll_s=CLIENT_CHECK_S):
                # Tokens may arrive faster than the poll interval, so check by the clock, not on idle.
                if time.monotonic() >= next_check_s:
                    next_check_s = time.monotonic() + CLIENT_CHECK_S
                    if client_gone(environ):
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
        # llama-server's names (prompt tokens reused and computed, their times and rates) beside Hearth's own.
        s = fin.stats
        prompt_n = s.num_prompt_tokens - s.num_cached_tokens
        prompt_ms = max(0.0, (s.ttft_ms or s.total_ms) - s.queue_ms)
        predicted_n = s.num_completion_tokens
        # The first token comes with the prompt's last batch: the generation rate is over the steps after it.
        steps = max(0, predicted_n - 1)
        predicted_ms = (s.tpot_ms or 0.0) * steps
        # Numbers only, none null (llama-server's timings are all finite numbers; clients sum and compare them).
        own = {k: v for k, v in s.as_dict().items() if isinstance(v, int | float) and not isinstance(v, bool)}
        return {**own, **_llama_timings(s.num_cached_tokens, prompt_n, prompt_ms, predicted_n, predicted_ms)}

    def _native_final(self, request: Request, params: SamplingParams, fin: Finished, text: str,
                      answer: _Answer, probs: list[dict] | None, stream: bool, slot: int) -> dict:
        """llama-server's last (or only) /completion object."""
        stopper = request.text_state[1] if request.text_state else None
        word = getattr(stopper, "matched_stop", "") if stopper is not None and stopper.stopped else ""
        stop_type = "limit" if fin.finish_reason == "length" else ("word" if word else "eos")
        out = {
            "index": answer.index, "content": text,
            "tokens": list(request.output_tokens) if answer.return_tokens and not stream else [],
            "id_slot": slot, "stop": True,
            "model": self.state.config.model_name,
            "tokens_predicted": fin.stats.num_completion_tokens, "tokens_evaluated": fin.stats.num_prompt_tokens,
            "generation_settings": self.generation_settings(params, n_probs=params.logprobs or 0, stream=stream),
            "prompt": self._detokenize(request.prompt_tokens),
            "has_new_line": "\n" in text, "truncated": False, "stop_type": stop_type, "stopping_word": word,
            "tokens_cached": fin.stats.num_prompt_tokens + fin.stats.num_completion_tokens,
            "timings": self._timings(fin),
        }
        if probs:
            out["completion_probabilities"] = [_native_prob(e, answer.post_sampling) for e in probs]
        if answer.response_fields:
            out = {f: _nested(out, f) for f in answer.response_fields}
        return out

    def _complete(self, environ, engine, request, params, rid, answer: _Answer) -> Response:
        parts: list[str] = []
        logprobs: list[dict] = []
        fin: Finished | None = None
        slot = -1  # the slot it ran in (the engine clears request.slot when it is released)
        for ev in self._events(environ, engine, request):
            if request.slot is not None:
                slot = request.slot
            if isinstance(ev, Delta):
                parts.append(ev.text)
                if ev.logprob is not None:
                    logprobs.append(ev.logprob)
            elif isinstance(ev, Finished):
                fin = ev
        if fin is None:  # client gone: nobody reads this, but answer sanely
            return _error(ApiError(499, "client closed the connection", code="client_closed"))
        if fin.error:
            status = 503 if fin.finish_reason == "cancelled" else 500
            return _error(ApiError(status, fin.error, code="generation_failed", err_type="server_error"))
        text = "".join(parts)
        created = int(time.time())
        model_name = self.state.config.model_name
        if answer.kind == NATIVE:
            return _json(self._native_final(request, params, fin, text, answer, logprobs, stream=False, slot=slot))
        finish = fin.finish_reason
        if answer.kind == CHAT:
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
        out = {
            "id": rid, "object": obj, "created": created, "model": model_name,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [choice], "usage": self._usage(fin), "timings": self._timings(fin),
            "hearth_class": fin.stats.class_name,  # the class the runner applied (timings hold numbers only)
        }
        if self.state.config.verbose or answer.verbose:
            out["__verbose"] = {"prompt": self._detokenize(request.prompt_tokens), "content": text}
        return _json(out)

    def _detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.state.model.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    def _stream(self, environ, engine, request, params, body, rid, answer: _Answer) -> Iterator[bytes]:
        created = int(time.time())
        model_name = self.state.config.model_name
        chat = answer.kind == CHAT
        native = answer.kind == NATIVE
        obj = "chat.completion.chunk" if chat else "text_completion"

        def sse(payload: dict) -> bytes:
            return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"

        def chunk(delta_text: str | None, finish: str | None, role: bool = False, extra: dict | None = None,
                  logprobs: list[dict] | None = None, tool_calls: list[dict] | None = None) -> bytes:
            if chat:
                delta = {}
                if role:
                    delta = {"role": "assistant", "content": None}
                if delta_text is not None:
                    delta["content"] = delta_text
                if tool_calls is not None:
                    delta["tool_calls"] = tool_calls
                lp = {"content": logprobs} if logprobs else None
                choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "",
                          "logprobs": _completion_logprobs(logprobs) if logprobs else None, "finish_reason": finish}
            payload = {"id": rid, "object": obj, "created": created, "model": model_name,
                       "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [choice]}
            if extra:
                payload.update(extra)
            return sse(payload)

        calls = toolfmt.ToolStream(answer.fmt, answer.tools) if chat and answer.tools else None
        pending: list[dict] = []  # logprobs of tokens whose text is still held back
        num_sent = 0  # generated tokens whose ids went out (return_tokens)
        slot = -1  # the slot it runs in (the engine clears request.slot when it is released)
        if chat:
            # llama-server's first chunk: the role, content null.
            yield chunk(None, None, role=True, extra=None)
        for ev in self._events(environ, engine, request):
            if request.slot is not None:
                slot = request.slot
            if isinstance(ev, Progress):
                extra = {"prompt_progress": ev._asdict(), "timings": _progress_timings(ev)}
                if native:
                    yield sse({"index": 0, "content": "", "tokens": [], "stop": False, "id_slot": slot,
                               "tokens_predicted": 0, "tokens_evaluated": ev.total, **extra})
                else:
                    yield chunk(None, None, extra=extra)
                continue
            if isinstance(ev, Delta):
                if ev.logprob is not None:
                    pending.append(ev.logprob)
                timed = {"timings": _running_timings(request)} if body.timings_per_token else None
                if native:
                    if not ev.text:
                        continue
                    upto = len(request.output_tokens)
                    out = {"index": 0, "content": ev.text,
                           "tokens": list(request.output_tokens[num_sent:upto]) if answer.return_tokens else [],
                           "stop": False, "id_slot": slot,
                           "tokens_predicted": upto, "tokens_evaluated": len(request.prompt_tokens), **(timed or {})}
                    num_sent = upto
                    if pending:
                        out["completion_probabilities"] = [_native_prob(e, answer.post_sampling) for e in pending]
                        pending = []
                    yield sse(out)
                    continue
                text = calls.push(ev.text) if calls is not None else ev.text
                if text:
                    yield chunk(text, None, logprobs=pending, extra=timed)
                    pending = []
                continue
            if ev.error:
                err = ApiError(503 if ev.finish_reason == "cancelled" else 500, ev.error,
                               code="generation_failed", err_type="server_error")
                yield sse(err.body())
            elif native:
                yield sse(self._native_final(request, params, ev, "", answer, pending, stream=True, slot=slot))
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
                yield chunk(None if chat else "", finish, extra={"usage": usage, "timings": self._timings(ev),
                                                                 "hearth_class": ev.stats.class_name},
                            logprobs=pending or None)
                if body.include_usage:
                    payload = {"id": rid, "object": obj, "created": created, "model": model_name,
                               "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [], "usage": usage,
                               "timings": self._timings(ev)}
                    yield sse(payload)
            if not native:
                yield b"data: [DONE]\n\n"


def sampling_params(body, max_tokens: int) -> SamplingParams:
    """The engine's sampling settings named by a request body (chat, completion, native or infill)."""
    return SamplingParams(
        max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
        seed=body.seed, repeat_penalty=body.repeat_penalty, repeat_last_n=body.repeat_last_n,
        frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty, stop=body.stops(),
        ignore_eos=body.ignore_eos,
    )


def _llama_timings(cache_n: int, prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> dict:
    """llama-server's timings object: counts and times with their per-token times and rates.

    The first token comes with the prompt's last batch, so the generation rate is over the steps after it."""
    steps = max(0, predicted_n - 1)
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
            "predicted_per_second": 1e3 * steps / predicted_ms if predicted_ms > 0 else 0.0}


def _running_timings(r: Request) -> dict:
    """llama-server's timings of a request still generating (timings_per_token): the prompt, the tokens so far."""
    start = r.first_scheduled_s if r.first_scheduled_s is not None else r.arrival_s
    first = r.first_token_s or start
    return _llama_timings(r.num_cached_tokens, len(r.prompt_tokens) - r.num_cached_tokens,
                          max(0.0, (first - start) * 1000), len(r.output_tokens),
                          max(0.0, ((r.last_token_s or first) - first) * 1000))


def _progress_timings(p: Progress) -> dict:
    """llama-server's timings beside a prompt_progress: the prompt so far, nothing generated yet."""
    return _llama_timings(p.cache, p.processed - p.cache, p.time_ms, 0, 0.0)


# How an answer is shaped.
CHAT = "chat"  # OpenAI chat completion
TEXT = "text"  # OpenAI text completion
NATIVE = "native"  # llama-server's /completion and /infill


@dataclass(frozen=True)
class _Answer:
    """How a request's answer is shaped: its kind, tool-call parsing, logprobs, llama-server's extras."""

    kind: str
    tools: list[dict] | None = None
    fmt: str = toolfmt.GENERIC
    logprobs: bool = False
    return_tokens: bool = False
    post_sampling: bool = False
    response_fields: tuple[str, ...] = ()
    index: int = 0
    verbose: bool = False  # llama-server's per-request `verbose`: the answer carries __verbose


def _native_prob(entry: dict, post_sampling: bool) -> dict:
    """A logprob entry in llama-server's completion_probabilities shape (probabilities when post_sampling)."""
    def one(e: dict) -> dict:
        base = {"id": e.get("id", -1), "token": e["token"], "bytes": e["bytes"]}
        if post_sampling:
            return {**base, "prob": math.exp(e["logprob"])}
        return {**base, "logprob": e["logprob"]}

    out = one(entry)
    top = [one(t) for t in entry.get("top_logprobs", [])]
    if post_sampling:
        top = [t for t in top if t["prob"] > 0.0]
    out["top_probs" if post_sampling else "top_logprobs"] = top
    return out


def _nested(obj: dict, path: str):
    """A field of llama-server's response_fields: "a/b" reads obj["a"]["b"]."""
    value = obj
    for part in path.split("/"):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


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
