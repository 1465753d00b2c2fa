"""Ollama's API as an adapter on OpenAI's shape: names and tags, keep_alive, options, messages, format,
tool calls, and the chat, generate and embed answers, whole or as an NDJSON stream.

Ollama's names carry a tag (`gemma:latest`); a name without one is its `:latest`. A chat or generate
request becomes an OpenAI chat request (a raw or fill-in-the-middle generate: a text completion), an
embed request an embeddings one; the OpenAI answer comes back as Ollama's, streamed as one JSON
object a line, tool calls sent whole once their deltas are complete. Errors are {"error": "message"}.

Thinking (app.protocols.thinking): `think` false turns it off, true on, "low"/"medium"/"high" on at
that effort; the model's reasoning (OpenAI's reasoning_content) is `message.thinking` (chat) or
`thinking` (generate), streamed on lines of its own, and an assistant turn's `thinking` in the history
is its reasoning_content. With `think: false` any thoughts the model produced anyway are dropped.
"""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from typing import Any

from app.protocols.openai import ApiError, image_part
from app.protocols.thinking import thinking_off, thinking_on, with_thinking

DEFAULT_TAG = "latest"
NDJSON = "application/x-ndjson"
NS_PER_MS = 1_000_000
# Ollama's option names with their OpenAI (and Hearth) names; other options are ignored, as Ollama
# ignores options a runner does not know. num_ctx is the admin's runner setting, not a client's.
OPTION_NAMES = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "stop": "stop",
}
# Ollama's think levels (gpt-oss reads them as its reasoning effort); true and false are the others.
THINK_LEVELS = ("low", "medium", "high")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def error_body(err: ApiError) -> tuple[int, dict]:
    """An ApiError in Ollama's shape, {"error": "message"} (its clients raise ResponseError with it): status and body."""
    return err.status, {"error": err.message}


def ndjson(obj: dict) -> bytes:
    """One line of an NDJSON stream."""
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def _error_text(payload: dict) -> str:
    """The message of an OpenAI-shaped error payload (as runners stream it), else the payload as text."""
    err = payload.get("error")
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


def _with_images(content: Any, images: Any, param: str) -> Any:
    """A message's content with its images (base64, as Ollama sends them) as OpenAI image parts before the
    text, where Ollama's prompt puts them; the content unchanged when there are none."""
    if not images:
        return content
    if not isinstance(images, list) or not all(isinstance(b, str) for b in images):
        raise ApiError(400, f"'{param}' must be a list of base64 strings", param=param)
    text = [{"type": "text", "text": content}] if isinstance(content, str) and content else []
    return [*(image_part(b) for b in images), *text]


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
        # Ollama's content is a Go string: missing or null reads as "" there (OpenAI's /v1 requires it).
        content = "" if m.get("content") is None else m.get("content")
        msg = {"role": m.get("role"), "content": _with_images(content, m.get("images"), f"messages.{i}.images")}
        if m.get("role") == "assistant" and isinstance(m.get("thinking"), str) and m["thinking"]:
            # An earlier answer's thoughts, as Ollama's clients send them back: templates that show past
            # reasoning (Qwen3) render it.
            msg["reasoning_content"] = m["thinking"]
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
    if body.get("logprobs"):
        raise ApiError(400, "'logprobs' is not supported by Hearth; remove it from the request", param="logprobs")
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    return out


def think_fields(think: Any) -> dict:
    """Ollama's `think` as OpenAI chat fields: false turns thinking off, true on, a level is its effort."""
    if think is None:
        return {}
    if think is False:
        return thinking_off()
    if think is True:
        return thinking_on()
    if think in THINK_LEVELS:
        return thinking_on(effort=think)
    raise ApiError(400, f"'think' must be true, false, \"low\", \"medium\" or \"high\" (got {think!r})", param="think")


def chat_to_openai(body: dict) -> dict:
    """An /api/chat body as a /v1/chat/completions one."""
    out = _common(body)
    out["messages"] = messages_to_openai(body.get("messages") or [], body["model"])
    if body.get("tools"):
        out["tools"] = body["tools"]
    return with_thinking(out, think_fields(body.get("think")))


def generate_to_openai(body: dict) -> tuple[dict, str]:
    """An /api/generate body as a /v1 one and its path: the prompt through the model's chat template
    (with `system`), or as it is when `raw`; `suffix` (fill in the middle) is a text completion."""
    if body.get("template"):
        raise ApiError(400, "'template': Hearth uses the model's own chat template; send 'raw': true with a "
                            "prompt you formatted yourself instead", param="template")
    if body.get("context"):
        raise ApiError(400, "'context' (tokens of an earlier answer) is not supported: Hearth returns none; send "
                            "the conversation to /api/chat instead", param="context")
    out = _common(body)
    prompt = body.get("prompt") or ""
    think = think_fields(body.get("think"))  # checked also where no template reads it
    if body.get("raw") or body.get("suffix"):
        if body.get("images"):
            raise ApiError(400, "'images' need the chat template: send them without 'raw' and 'suffix'",
                           param="images")
        out["prompt"] = prompt
        if body.get("suffix"):
            out["suffix"] = body["suffix"]
        return out, "/v1/completions"
    messages = [{"role": "system", "content": body["system"]}] if body.get("system") else []
    out["messages"] = [*messages, {"role": "user", "content": _with_images(prompt, body.get("images"), "images")}]
    return with_thinking(out, think), "/v1/chat/completions"


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


def _whole_call(call: dict) -> dict | None:
    """An OpenAI call gathered from deltas, as Ollama's, once its arguments are a whole JSON object (else None)."""
    args = call["function"]["arguments"]
    if not args.rstrip().endswith("}"):
        return None
    try:
        return tool_calls_from_openai([call])[0]
    except ValueError:
        return None


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


class _Generation:
    """/api/chat or /api/generate on OpenAI's chat (or text completion) shape."""

    stream_mimetype = NDJSON
    kind = ""  # "chat" or "generate": where the answer's text goes (message.content or response)

    def __init__(self, body: dict):
        self.body = body
        self.model = body.get("model")  # the name as the client gave it, echoed in every answer
        self.started_s = time.monotonic()
        self._calls: dict[int, dict] = {}
        self._sent: set[int] = set()  # the indices of calls already streamed
        self._finish: str | None = None
        self._usage: dict | None = None
        self._timings: dict | None = None
        self._failed = False
        # think: false turns the template's thinking off; thoughts a model produces anyway are dropped.
        self.shows_thinking = body.get("think") is not False

    def to_openai(self) -> dict:
        """The Ollama body as an OpenAI request."""
        raise NotImplementedError

    def line(self, content: str, done: bool, tool_calls: list | None = None, thinking: str = "", **extra) -> dict:
        """One answer object: the whole answer, a streamed piece, or the stream's last line (done); the
        model's thoughts in `thinking` (message.thinking for chat, beside `response` for generate)."""
        out: dict[str, Any] = {"model": self.model, "created_at": _created_at()}
        shown = thinking if self.shows_thinking else ""
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if shown:
                message["thinking"] = shown
            if tool_calls:
                message["tool_calls"] = tool_calls
            out["message"] = message
        else:
            out["response"] = content
            if shown:
                out["thinking"] = shown
        out["done"] = done
        out.update(extra)
        return out

    def answer(self, completion: dict) -> dict:
        """A whole OpenAI completion as Ollama's answer (an error object when its tool calls are not JSON)."""
        choice = (completion.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        try:
            if self.kind == "chat":
                calls = message.get("tool_calls") or []
                if choice.get("finish_reason") == "length":
                    # A relayed server may return the call it was cut inside: only the whole ones are calls.
                    calls = [c for c in calls if _whole_call({"function": {**c.get("function", {}), "arguments":
                                                             (c.get("function") or {}).get("arguments") or ""}})]
                text, calls = message.get("content") or "", tool_calls_from_openai(calls)
            else:
                text, calls = choice.get("text") or message.get("content") or "", None
        except ValueError as exc:
            return {"error": str(exc)}
        return self.line(text, True, calls, thinking=message.get("reasoning_content") or "",
                         done_reason=_done_reason(choice.get("finish_reason")),
                         **_stats(completion.get("usage"), completion.get("timings"), self.started_s))

    def start(self) -> list[bytes]:
        """Ollama's stream opens with its first piece: nothing before it."""
        return []

    def feed(self, chunk: dict) -> list[bytes]:
        """A line per piece of text; tool-call deltas are gathered until the end; an error ends the stream."""
        if self._failed:
            return []
        if chunk.get("error"):
            self._failed = True
            return [ndjson({"error": _error_text(chunk)})]
        self._usage = chunk.get("usage") or self._usage
        self._timings = chunk.get("timings") or self._timings
        out = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") if self.kind == "chat" else choice.get("text")
            if self.kind == "generate" and text is None:
                text = delta.get("content")
            thought = delta.get("reasoning_content") if self.shows_thinking else None
            if thought:
                out.append(ndjson(self.line("", False, thinking=thought)))
            if text:
                out.append(ndjson(self.line(text, False)))
            for call in delta.get("tool_calls") or []:
                index = call.get("index", len(self._calls))
                acc = self._calls.setdefault(index, {"function": {"name": "", "arguments": ""}})
                fn = call.get("function") or {}
                acc["function"]["name"] += fn.get("name") or ""
                acc["function"]["arguments"] += fn.get("arguments") or ""
                whole = _whole_call(acc) if index not in self._sent else None
                if whole is not None:
                    # Each call goes out as soon as its arguments are a whole object, as Ollama streams calls.
                    self._sent.add(index)
                    out.append(ndjson(self.line("", False, [whole])))
            self._finish = choice.get("finish_reason") or self._finish
        return out

    def end(self) -> list[bytes]:
        """The tool calls not streamed yet, then the done line with the counters; an error when the answer was cut
        short of its end, or a call that ended by itself is not JSON. A call cut by max_tokens is left out: the
        ones before it went out."""
        if self._failed:
            return []
        out = []
        rest = [self._calls[i] for i in sorted(self._calls) if i not in self._sent]
        if rest and self._finish != "length":
            try:
                whole = tool_calls_from_openai(rest)
            except ValueError as exc:
                return [ndjson({"error": str(exc)})]
            out.append(ndjson(self.line("", False, whole)))
        if self._finish is None:
            return [*out, ndjson({"error": "the answer ended before the model finished; retry"})]
        out.append(ndjson(self.line("", True, done_reason=_done_reason(self._finish),
                                    **_stats(self._usage, self._timings, self.started_s))))
        return out

    def error(self, err: ApiError) -> tuple[int, dict]:
        """An error as Ollama answers it."""
        return error_body(err)


class ChatAdapter(_Generation):
    """POST /api/chat."""

    kind = "chat"

    def to_openai(self) -> dict:
        """The chat body as a /v1/chat/completions one."""
        return chat_to_openai(self.body)


class GenerateAdapter(_Generation):
    """POST /api/generate: the prompt in the model's chat template, or a text completion (raw, suffix)."""

    kind = "generate"

    def to_openai(self) -> dict:
        """The generate body as a /v1 one (see `path`)."""
        return generate_to_openai(self.body)[0]

    @property
    def path(self) -> str:
        """The OpenAI route that answers it: /v1/chat/completions, or /v1/completions when raw or with a suffix."""
        return generate_to_openai(self.body)[1]


class EmbedAdapter:
    """POST /api/embed (one input or many) as /v1/embeddings."""

    stream_mimetype = NDJSON
    input_field = "input"

    def __init__(self, body: dict):
        self.body = body
        self.model = body.get("model")
        self.started_s = time.monotonic()

    def to_openai(self) -> dict:
        """The Ollama body as an OpenAI embeddings body."""
        out = {"model": self.model, "input": self.body.get(self.input_field)}
        for key in ("truncate", "dimensions"):
            if self.body.get(key) is not None:
                out[key] = self.body[key]
        return out

    def answer(self, completion: dict) -> dict:
        """Vectors in Ollama's shape."""
        vectors = [d["embedding"] for d in sorted(completion.get("data") or [], key=lambda d: d["index"])]
        usage = completion.get("usage") or {}
        return {"model": self.model, "embeddings": vectors, "total_duration": int((time.monotonic() - self.started_s) * 1e9),
                "load_duration": 0, "prompt_eval_count": usage.get("prompt_tokens", 0)}

    def start(self) -> list[bytes]:
        """Embeddings are never streamed: nothing."""
        return []

    def feed(self, chunk: dict) -> list[bytes]:
        """Embeddings are never streamed: nothing."""
        return []

    def end(self) -> list[bytes]:
        """Embeddings are never streamed: nothing."""
        return []

    def error(self, err: ApiError) -> tuple[int, dict]:
        """An error as Ollama answers it."""
        return error_body(err)


class EmbeddingsAdapter(EmbedAdapter):
    """POST /api/embeddings, the older endpoint: one prompt, one vector."""

    input_field = "prompt"

    def answer(self, completion: dict) -> dict:
        """The one vector in the older endpoint's shape."""
        vectors = [d["embedding"] for d in sorted(completion.get("data") or [], key=lambda d: d["index"])]
        return {"embedding": vectors[0] if vectors else []}
