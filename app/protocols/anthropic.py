"""Anthropic's Messages API as an adapter on OpenAI's chat shape: MessagesAdapter.

Coding tools that speak Anthropic's API (Claude Code and others) can point at a local runner or
the gateway this way. As llama-server does, a request is translated into an OpenAI chat request
(system, text and image blocks, tool_use / tool_result, tools, tool_choice, stop_sequences,
output_config.format, sampling) and the chat answer is translated back: a `message` with content
blocks, or Anthropic's event stream (message_start, content_block_start / _delta / _stop,
message_delta, message_stop). Errors take Anthropic's shape, {"type": "error", "error": {"type", "message"}}.
Pure wire format: the runner feeds it chat chunks built from its engine's events, the gateway the
chunks it relays.

Extended thinking: `thinking: {"type": "enabled", "budget_tokens": N}` turns the model's thinking on
with a budget of N thinking tokens (llama-server's thinking_budget_tokens), "adaptive" on without
one, "disabled" off (app.protocols.thinking). The model's reasoning (OpenAI's reasoning_content)
is a `thinking` block before the text and tool_use blocks, streamed as thinking_delta events. Its
`signature` is always "" (as llama-server sends it): Anthropic signs thoughts with a key of its own so
that they cannot be forged, and Hearth has no such key, so it claims nothing; a signature_delta of ""
closes each streamed thinking block because Anthropic's clients wait for one. Thinking blocks of the
history become the assistant turn's `reasoning_content`, which templates that show past reasoning
render; redacted_thinking blocks are dropped. With thinking disabled, thoughts the model produces
anyway are dropped from the answer.

Not honoured: `metadata`, `cache_control` (the prefix cache needs no hint), and `stop_sequence` in
the answer, which stays null (stop_reason is then "end_turn", as llama-server reports it).
"""

from __future__ import annotations

import json
import re
import uuid

from app.protocols import sse
from app.protocols.openai import ApiError, image_part
from app.protocols.thinking import thinking_off, thinking_on, with_thinking

# llama-server answers 500 with this message when a request carries an image and no vision
# projector is loaded; clients written against it (and its own tests) look for these words.
IMAGE_UNSUPPORTED = "image input is not supported by this runner: its model has no vision projector (mmproj)"

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# Claude Code stamps its system prompt with a per-request hash (cch=xxxxx;) that would defeat the
# prefix cache at the first line; llama-server blanks it the same way (llama.cpp PR 21793).
_BILLING_CCH = re.compile(r"^(x-anthropic-billing-header:.*?cch=)[0-9a-fA-F]{5};")
# Block types of the history that carry nothing the model can be shown (redacted reasoning is opaque).
_IGNORED_BLOCKS = ("redacted_thinking",)


def image_unsupported() -> ApiError:
    """The error for an image in a request (500, as llama-server answers it)."""
    return ApiError(500, IMAGE_UNSUPPORTED, code="image_unsupported", err_type="server_error")


def error_body(err: ApiError) -> tuple[int, dict]:
    """An ApiError in Anthropic's shape: status and body."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return err.status, {"type": "error", "error": {"type": kind, "message": err.message}}


def _system_text(system) -> str:
    if isinstance(system, str):
        parts = [system]
    elif isinstance(system, list):
        parts = [b.get("text", "") for b in system if isinstance(b, dict) and b.get("type") == "text"]
    else:
        raise ApiError(400, "'system' must be a string or a list of text blocks", param="system")
    return "\n".join(_BILLING_CCH.sub(r"\1fffff;", p) for p in parts)


def _tool_result_text(block: dict) -> str:
    content = block.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, "'tool_result.content' must be a string or a list of blocks", param="messages")
    texts = []
    for c in content:
        kind = c.get("type") if isinstance(c, dict) else None
        if kind == "image":
            raise image_unsupported()
        if kind != "text":
            raise ApiError(400, f"'tool_result.content': block type {kind!r} is not supported (text only)",
                           param="messages")
        texts.append(c.get("text", ""))
    return "".join(texts)


def _message(i: int, msg) -> list[dict]:
    """One Anthropic message as OpenAI chat messages (tool results become tool messages)."""
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
        raise ApiError(400, f"'messages.{i}': each message needs a role of user or assistant", param="messages")
    role, content = msg["role"], msg.get("content")
    if content is None or isinstance(content, str):
        return [{"role": role, "content": content or ""}]
    if not isinstance(content, list):
        raise ApiError(400, f"'messages.{i}.content' must be a string or a list of blocks", param="messages")
    texts, calls, results, thoughts = [], [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text = block.get("text", "")
            if not isinstance(text, str):
                raise ApiError(400, f"'messages.{i}.content.{j}.text' must be a string", param="messages")
            texts.append({"type": "text", "text": text})
        elif kind == "thinking":
            thoughts.append(str(block.get("thinking") or ""))
        elif kind == "image":
            if role != "user":
                raise ApiError(400, f"'messages.{i}.content.{j}': images go in user messages", param="messages")
            texts.append(image_part(_image_url(block, f"messages.{i}.content.{j}")))
        elif kind == "tool_use":
            calls.append({"id": block.get("id", ""), "type": "function",
                          "function": {"name": block.get("name", ""),
                                       "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""),
                            "content": _tool_result_text(block)})
        elif kind not in _IGNORED_BLOCKS:
            raise ApiError(400, f"'messages.{i}.content.{j}': block type {kind!r} is not supported", param="messages")
    out: list[dict] = []
    # Tool results answer the previous assistant turn, so they come first (OpenAI's order), the
    # message's own text after them.
    out += results
    reasoning = "\n".join(t for t in thoughts if t)
    if role == "assistant" and (texts or calls or reasoning):
        text = "".join(t["text"] for t in texts)
        out.append({"role": "assistant", "content": text or ("" if reasoning and not calls else None),
                    **({"tool_calls": calls} if calls else {}), **({"reasoning_content": reasoning} if reasoning else {})})
    elif texts:
        out.append({"role": role, "content": texts})
    return out


def _image_url(block: dict, where: str) -> str:
    """An image block's source as an image URL: base64 data as a data URL, a url source as it is."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise ApiError(400, f"'{where}.source' must be an object", param="messages")
    if source.get("type") == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise ApiError(400, f"'{where}.source' needs media_type and data (base64)", param="messages")
        return f"data:{media_type};base64,{data}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ApiError(400, f"'{where}.source.type' must be base64 or url", param="messages")


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(400, f"'tools.{i}': tool type {kind!r} is not supported; the runner calls client tools "
                                "(name, description, input_schema) only", param="tools")
        fn = {"name": tool.get("name", ""), "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice) -> str | dict:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name", "")}}
    raise ApiError(400, "'tool_choice.type' must be one of auto, any, tool, none", param="tool_choice")


def thinking_fields(thinking) -> dict:
    """Anthropic's `thinking` as OpenAI chat fields: enabled (with its budget of thinking tokens), adaptive, disabled."""
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return thinking_off()
    if kind == "adaptive":
        return thinking_on()
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if budget is None:
            return thinking_on()
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ApiError(400, f"'thinking.budget_tokens' must be a whole number of tokens, 0 or more (got {budget!r})",
                           param="thinking")
        return thinking_on(budget_tokens=budget)
    raise ApiError(400, "'thinking.type' must be one of enabled, adaptive, disabled", param="thinking")


def shows_thinking(body: dict) -> bool:
    """Whether an answer carries the model's thoughts: always, unless the request disabled thinking."""
    thinking = body.get("thinking")
    return not (isinstance(thinking, dict) and thinking.get("type") == "disabled")


def to_chat(body: dict) -> dict:
    """An Anthropic Messages request as an OpenAI chat request."""
    if "messages" not in body:
        raise ApiError(400, "'messages' is required", param="messages")
    if not isinstance(body["messages"], list):
        raise ApiError(400, "'messages' must be a list", param="messages")
    messages: list[dict] = []
    if body.get("system"):
        messages.append({"role": "system", "content": _system_text(body["system"])})
    for i, msg in enumerate(body["messages"]):
        messages += _message(i, msg)
    if not any(m["role"] != "system" for m in messages):
        # llama-server answers an empty conversation too; an empty user turn is the least it can be.
        messages.append({"role": "user", "content": ""})
    chat: dict = {"messages": messages}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
        if chat["tool_choice"] == "none":
            chat.pop("tools", None)
    fmt = (body.get("output_config") or {}).get("format")
    if fmt:
        # Structured outputs: the answer is constrained to the schema, as the chat route's json_schema.
        if fmt.get("type") != "json_schema":
            raise ApiError(400, "'output_config.format.type' must be json_schema", param="output_config")
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": fmt.get("schema") or {}}}
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    for key in ("max_tokens", "temperature", "top_p", "top_k", "stream"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}  # the token counts of message_delta
    return with_thinking(chat, thinking_fields(body.get("thinking")))


def _input_usage(usage: dict) -> dict:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage.get("prompt_tokens", 0) - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def thinking_block(text: str) -> dict:
    """A thinking block of an answer; its signature is empty (see the module docstring)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def to_message(chat: dict, msg_id: str, thoughts: bool = True) -> dict:
    """An OpenAI chat completion as an Anthropic message: its thinking block (unless `thoughts` is
    false), then text, then tool_use blocks."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict] = []
    if thoughts and message.get("reasoning_content"):
        content.append(thinking_block(message["reasoning_content"]))
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _tool_input(call["function"]["arguments"])})
    usage = chat.get("usage") or {}
    return {"id": msg_id, "type": "message", "role": "assistant", "model": chat.get("model"), "content": content,
            "stop_reason": STOP_REASONS.get(choice.get("finish_reason"), "end_turn"), "stop_sequence": None,
            "usage": {**_input_usage(usage), "output_tokens": usage.get("completion_tokens", 0)}}


class MessageStream:
    """Turns the chat stream's chunks into Anthropic's events, one block open at a time."""

    def __init__(self, msg_id: str, model: str | None, input_tokens: int, thoughts: bool = True):
        self.msg_id = msg_id
        self.model = model
        self.input_tokens = input_tokens
        self.thoughts = thoughts  # whether the model's reasoning is streamed as thinking blocks
        self.started = False
        self.ended = False  # a finish or an error has been sent
        self.index = -1  # the open block's index
        self.open = None  # "thinking", "text", "tool_use" or None
        # The stop reason once the chat stream finished, until the usage is known: a stock llama-server
        # sends it in a chunk of its own after the finish (include_usage).
        self.stop_reason: str | None = None

    def start(self) -> list[bytes]:
        """message_start, once: the message so far (empty) and the prompt's size."""
        if self.started:
            return []
        self.started = True
        return [sse.encode({"type": "message_start", "message": {
            "id": self.msg_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0, "output_tokens": 0}}}, "message_start")]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        # Anthropic's clients wait for a thinking block's signature before its end: an empty one.
        out = [self._delta({"type": "signature_delta", "signature": ""})] if self.open == "thinking" else []
        self.open = None
        return out + [sse.encode({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def _open(self, block: dict) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [sse.encode({"type": "content_block_start", "index": self.index, "content_block": block},
                                 "content_block_start")]

    def _delta(self, delta: dict) -> bytes:
        return sse.encode({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def feed(self, chunk: dict) -> list[bytes]:
        """The events for one chunk of the chat stream (message_start first, if start() has not sent it)."""
        out = self.start()
        if "error" in chunk:
            self.ended = True
            message = (chunk["error"] or {}).get("message", "")
            return out + [sse.encode({"type": "error", "error": {"type": "api_error", "message": message}}, "error")]
        for choice in chunk.get("choices") or []:
            out += self._choice(choice)
        if self.stop_reason is not None and not self.ended and chunk.get("usage"):
            out += self.finish(chunk["usage"])
        return out

    def finish(self, usage: dict) -> list[bytes]:
        """message_delta (stop reason, token counts) and message_stop, once the chat stream has finished."""
        self.ended = True
        return [sse.encode({
            "type": "message_delta", "delta": {"stop_reason": self.stop_reason, "stop_sequence": None},
            "usage": {**_input_usage(usage), "output_tokens": usage.get("completion_tokens", 0)}}, "message_delta"),
            sse.encode({"type": "message_stop"}, "message_stop")]

    def _choice(self, choice: dict) -> list[bytes]:
        out: list[bytes] = []
        delta = choice.get("delta") or {}
        if self.thoughts and delta.get("reasoning_content"):
            if self.open != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.open != "text":
                out += self._open({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):
                out += self._open({"type": "tool_use", "id": call["id"], "name": fn.get("name", ""), "input": {}})
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        if choice.get("finish_reason") is not None and self.stop_reason is None:
            self.stop_reason = STOP_REASONS.get(choice["finish_reason"], "end_turn")
            out += self._close()
        return out


class MessagesAdapter(MessageStream):
    """Anthropic's Messages API on OpenAI's chat shape (app.protocols.adapter's interface); its stream is a MessageStream."""

    stream_mimetype = "text/event-stream"

    def __init__(self, body: dict, input_tokens: int = 0):
        # The prompt's size for message_start; a runner knows it before generating, a relay does not (0:
        # message_delta then carries the count).
        super().__init__("msg_" + uuid.uuid4().hex[:24], body.get("model"), input_tokens, shows_thinking(body))
        self.body = body

    def to_openai(self) -> dict:
        """The Messages request as a chat request, its model as the client named it."""
        return {**to_chat(self.body), "model": self.body.get("model")}

    def answer(self, completion: dict) -> dict:
        """A chat completion as an Anthropic message."""
        return to_message(completion, self.msg_id, self.thoughts)

    def end(self) -> list[bytes]:
        """Nothing after message_stop; an error event when the chat stream stopped before its finish."""
        if self.ended:
            return []
        if self.stop_reason is not None:
            return self.finish({})  # finished, and no usage came
        return self.feed({"error": {"message": "the answer ended before it was complete"}})

    def error(self, err: ApiError) -> tuple[int, dict]:
        """Anthropic's error shape."""
        return error_body(err)
