"""OpenAI's Responses API, stateless, as an adapter on OpenAI's chat shape: ResponsesAdapter.

Newer OpenAI clients (`client.responses.create`) speak it. As llama-server does, a request is
translated into a chat request — `instructions` and `input` (a string or a list of items:
messages, function_call, function_call_output), function `tools`, `tool_choice`, `text.format`,
`max_output_tokens`, sampling — and the chat answer is translated back: a `response` object with
message and function_call output items, or the event stream (response.created,
response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta, …, response.completed), every event numbered by `sequence_number` as
OpenAI numbers them. Errors keep OpenAI's shape. Pure wire format, shared by the runner and the gateway.

Stateless: nothing is stored, so `previous_response_id` is refused (400), as llama-server refuses
it. Tools other than functions (web_search, file_search, …) have no chat equivalent and are
skipped, as llama-server skips them, so clients that always send them still work. The status is
"completed" also when max_output_tokens cut the answer (llama-server's behaviour); the usage says
how many tokens were produced.

Reasoning: `reasoning.effort` is the chat request's reasoning_effort ("none" turns thinking off). The
model's reasoning (OpenAI's reasoning_content) is a `reasoning` output item before the message and
function calls, its text in `content` as one `reasoning_text` part, streamed as
response.reasoning_text.delta events; `usage.output_tokens_details.reasoning_tokens` is the runner's
count. Hearth writes no summaries (`summary` is [] whatever `reasoning.summary` asks) and encrypts
nothing (`encrypted_content` is null). A reasoning item of the input becomes the next assistant
turn's reasoning_content (its reasoning_text, else its summary's text). With effort "none", thoughts
a model produces anyway are dropped.
"""

from __future__ import annotations

import json
import time
import uuid

from app.protocols import sse
from app.protocols.openai import ApiError, image_part
from app.protocols.thinking import EFFORT_OFF, effort, reasoning_tokens

# Chat parameters that a Responses request carries under the same name.
_PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "stream", "parallel_tool_calls", "presence_penalty",
           "frequency_penalty", "repeat_penalty", "stop", "return_progress", "timings_per_token")
_TEXT_PARTS = ("input_text", "output_text")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _content(i: int, content) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"'input.{i}.content' must be a string or a list of parts", param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "refusal":
            parts.append({"type": "text", "text": part.get("refusal", "")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise ApiError(400, f"'input.{i}.content': an input_image needs image_url (a data URL); file_id "
                                    "is not supported", param="input")
            parts.append(image_part(url))
        else:
            raise ApiError(400, f"'input.{i}.content': part type {kind!r} is not supported "
                                f"(use {', '.join(_TEXT_PARTS)})", param="input")
    return parts


def _text(parts: list[dict], i: int) -> str:
    if any(p["type"] != "text" for p in parts):
        raise ApiError(400, f"'input.{i}': images go in user messages, not in answers or tool outputs", param="input")
    return "".join(p["text"] for p in parts)


def _items(items: list) -> list[dict]:
    """Input items as chat messages; an assistant's function calls join its message, as in chat."""
    out: list[dict] = []

    def assistant() -> dict:
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": None})
        return out[-1]

    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ApiError(400, f"'input.{i}' must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in ("user", "system", "developer"):
            out.append({"role": item["role"], "content": _content(i, item.get("content", ""))})
        elif kind == "message" and item.get("role") == "assistant":
            msg = assistant()
            msg["content"] = (msg["content"] or "") + _text(_content(i, item.get("content", "")), i)
        elif kind == "function_call":
            assistant().setdefault("tool_calls", []).append(
                {"id": item.get("call_id", ""), "type": "function",
                 "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "{}")}})
        elif kind == "function_call_output":
            output = item.get("output", "")
            text = output if isinstance(output, str) else _text(_content(i, output), i)
            out.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": text})
        elif kind == "reasoning":
            text = _reasoning_text(item)
            if text:
                msg = assistant()
                msg["reasoning_content"] = "\n".join(t for t in (msg.get("reasoning_content"), text) if t)
        else:
            raise ApiError(400, f"'input.{i}': item type {kind!r} is not supported", param="input")
    thoughts_alone = [m for m in out if m["role"] == "assistant" and m["content"] is None and not m.get("tool_calls")]
    if thoughts_alone and out[-1] is thoughts_alone[-1]:
        # Thoughts that answer nothing yet, at the end: a template would read them as an answer to continue.
        out.pop()
    for msg in thoughts_alone:
        msg["content"] = ""
    return out


def _reasoning_text(item: dict) -> str:
    """The text of an input reasoning item: its reasoning_text parts, else its summary's."""
    def texts(parts, kind: str) -> str:
        parts = parts if isinstance(parts, list) else []
        return "".join(str(p.get("text") or "") for p in parts if isinstance(p, dict) and p.get("type") == kind)

    return texts(item.get("content"), "reasoning_text") or texts(item.get("summary"), "summary_text")


def _format(text) -> dict | None:
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if fmt and not isinstance(fmt, dict):
        raise ApiError(400, "'text.format' must be an object such as {\"type\": \"json_object\"}", param="text")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                       "schema": fmt.get("schema") or {},
                                                       "strict": fmt.get("strict")}}
    raise ApiError(400, "'text.format.type' must be one of text, json_object, json_schema", param="text")


def to_chat(body: dict) -> dict:
    """A Responses request as an OpenAI chat request."""
    if body.get("previous_response_id"):
        raise ApiError(400, "'previous_response_id' is not supported: this runner is stateless; send the "
                            "conversation in 'input'", param="previous_response_id")
    if "input" not in body:
        raise ApiError(400, "'input' is required", param="input")
    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": str(body["instructions"])})
    value = body["input"]
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        messages += _items(value)
    else:
        raise ApiError(400, "'input' must be a string or a list of items", param="input")
    chat: dict = {"messages": messages}
    offered = body.get("tools")
    if offered is not None and not isinstance(offered, list):
        raise ApiError(400, "'tools' must be a list of tools", param="tools")
    tools = [t for t in offered or [] if isinstance(t, dict) and t.get("type") == "function"]
    if tools:
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                          "strict") if t.get(k) is not None}}
                         for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        chat["tool_choice"] = choice
    elif isinstance(choice, dict):
        if choice.get("type") != "function":
            raise ApiError(400, "'tool_choice' must be auto, none, required or a function", param="tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name", "")}}
    if chat.get("tool_choice") == "none" or (not tools and chat.get("tool_choice") == "auto"):
        chat.pop("tools", None)
        chat.pop("tool_choice", None)
    rf = _format(body.get("text"))
    if rf is not None:
        chat["response_format"] = rf
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}  # the usage of response.completed
    reasoning = _reasoning(body)
    if reasoning.get("effort") is not None:
        chat["reasoning_effort"] = effort(reasoning["effort"], "reasoning.effort")
    for key in _PASSED:
        if body.get(key) is not None:
            chat[key] = body[key]
    return chat


def shows_reasoning(body: dict) -> bool:
    """Whether the answer carries the model's reasoning: unless the request's effort is "none"."""
    return _reasoning(body).get("effort") != EFFORT_OFF


def _reasoning(body: dict) -> dict:
    """The request's reasoning object ({} when absent); a 400 for anything else (a bare "high" once was a 500)."""
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise ApiError(400, "'reasoning' must be an object such as {\"effort\": \"low\"}", param="reasoning")
    return reasoning or {}


def _usage(usage: dict) -> dict:
    n_in, n_out = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens(usage)}, "total_tokens": n_in + n_out}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    """A reasoning output item: the model's thoughts as one reasoning_text part (none while it opens)."""
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [_reasoning_part(text)] if text else [], "encrypted_content": None}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _message_item(msg_id: str, text: str, status: str = "completed") -> dict:
    return {"id": msg_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}


def _is_object(arguments: str) -> bool:
    """Whether a call's arguments text is a whole JSON object."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": "fc_" + call_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def _response(resp_id: str, body: dict, model: str, created: int, output: list[dict], usage: dict | None,
              status: str = "completed") -> dict:
    """The `response` object (OpenAI's fields; what was asked is echoed back)."""
    out = {"id": resp_id, "object": "response", "created_at": created, "status": status, "model": model,
           "output": output, "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
           "max_output_tokens": body.get("max_output_tokens"), "parallel_tool_calls": body.get("parallel_tool_calls",
                                                                                               True),
           "temperature": body.get("temperature"), "top_p": body.get("top_p"),
           "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
           "text": body.get("text") or {"format": {"type": "text"}}, "store": False,
           "metadata": body.get("metadata") or {}, "usage": usage,
           "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"),
                         "summary": (body.get("reasoning") or {}).get("summary")}}
    if status == "completed":
        out["completed_at"] = int(time.time())
    return out


def to_response(chat: dict, body: dict, resp_id: str) -> dict:
    """An OpenAI chat completion as a Responses `response`."""
    message = chat["choices"][0]["message"]
    output = []
    if message.get("reasoning_content") and shows_reasoning(body):
        output.append(_reasoning_item(_new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        output.append(_message_item(_new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return _response(resp_id, body, chat.get("model"), chat.get("created", int(time.time())), output,
                     _usage(chat.get("usage") or {}))


class ResponseStream:
    """Turns the chat route's stream chunks into the Responses API's events."""

    def __init__(self, resp_id: str, body: dict, model: str):
        self.resp_id = resp_id
        self.body = body
        self.model = model
        self.created = int(time.time())
        self.seq = 0
        self.output: list[dict] = []  # finished items
        self.text: str | None = None  # the open message's text so far
        self.msg_id = _new_id("msg")
        self.thought: str | None = None  # the open reasoning item's text so far
        self.thought_id = ""
        self.thoughts = shows_reasoning(body)
        self.call: dict | None = None  # the open function call
        self.ended = False  # response.completed or response.failed has been sent
        # The chat stream has finished; response.completed waits for the usage, which a stock llama-server
        # sends in a chunk of its own after the finish (include_usage).
        self.finished = False

    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse.encode(data, kind)

    def _snapshot(self, status: str, usage: dict | None = None) -> dict:
        return _response(self.resp_id, self.body, self.model, self.created, list(self.output), usage, status)

    def start(self) -> list[bytes]:
        """The opening events."""
        return [self._event("response.created", response=self._snapshot("in_progress")),
                self._event("response.in_progress", response=self._snapshot("in_progress"))]

    def _close(self) -> list[bytes]:
        out = []
        index = len(self.output)
        if self.thought is not None:
            item = _reasoning_item(self.thought_id, self.thought)
            out += [self._event("response.reasoning_text.done", item_id=self.thought_id, output_index=index,
                                content_index=0, text=self.thought),
                    self._event("response.content_part.done", item_id=self.thought_id, output_index=index,
                                content_index=0, part=_reasoning_part(self.thought)),
                    self._event("response.output_item.done", output_index=index, item=item)]
            self.output.append(item)
            self.thought = None
        elif self.text is not None:
            item = _message_item(self.msg_id, self.text)
            part = item["content"][0]
            out += [self._event("response.output_text.done", item_id=self.msg_id, output_index=index,
                                content_index=0, text=self.text, logprobs=[]),
                    self._event("response.content_part.done", item_id=self.msg_id, output_index=index,
                                content_index=0, part=part),
                    self._event("response.output_item.done", output_index=index, item=item)]
            self.output.append(item)
            self.text = None
        elif self.call is not None:
            # A call cut before its arguments came whole (its name went out first) is an incomplete item.
            status = "completed" if _is_object(self.call["arguments"]) else "incomplete"
            item = _call_item(self.call["call_id"], self.call["name"], self.call["arguments"], status)
            out += [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
            self.output.append(item)
            self.call = None
        return out

    def feed(self, chunk: dict) -> list[bytes]:
        """The events for one chunk of the chat stream."""
        if "error" in chunk:
            err = chunk["error"]
            self.ended = True
            return [self._event("error", code=err.get("code"), message=err.get("message", ""), param=None),
                    self._event("response.failed", response={
                        **self._snapshot("failed"), "error": {"code": err.get("code") or "server_error",
                                                              "message": err.get("message", "")}})]
        out: list[bytes] = []
        if "prompt_progress" in chunk:
            # llama-server's telemetry (return_progress): the prompt's progress as an in_progress event.
            out.append(self._event("response.in_progress", response=self._snapshot("in_progress"),
                                   prompt_progress=chunk["prompt_progress"], timings=chunk.get("timings")))
            return out
        timed = {"timings": chunk["timings"]} if "timings" in chunk else {}
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if self.thoughts and delta.get("reasoning_content"):
                out += self._thought(delta["reasoning_content"], timed)
            if delta.get("content"):
                if self.text is None:
                    out += self._close()
                    index = len(self.output)
                    out += [self._event("response.output_item.added", output_index=index,
                                        item=_message_item(self.msg_id, "", "in_progress")),
                            self._event("response.content_part.added", item_id=self.msg_id, output_index=index,
                                        content_index=0,
                                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
                    self.text = ""
                self.text += delta["content"]
                out.append(self._event("response.output_text.delta", item_id=self.msg_id, output_index=len(self.output),
                                       content_index=0, delta=delta["content"], logprobs=[], **timed))
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if call.get("id"):
                    out += self._close()
                    self.call = {"call_id": call["id"], "name": fn.get("name", ""), "arguments": ""}
                    out.append(self._event("response.output_item.added", output_index=len(self.output),
                                           item=_call_item(call["id"], self.call["name"], "", "in_progress")))
                if fn.get("arguments") and self.call is not None:
                    self.call["arguments"] += fn["arguments"]
                    out.append(self._event("response.function_call_arguments.delta",
                                           item_id="fc_" + self.call["call_id"], output_index=len(self.output),
                                           delta=fn["arguments"]))
            if choice.get("finish_reason") is not None and not self.finished:
                self.finished = True
                out += self._close()
        if self.finished and not self.ended and chunk.get("usage"):
            out += self.complete(chunk["usage"], timed)
        return out

    def complete(self, usage: dict, timed: dict | None = None) -> list[bytes]:
        """response.completed with the usage, once the chat stream has finished."""
        self.ended = True
        return [self._event("response.completed", response=self._snapshot("completed", _usage(usage)), **(timed or {}))]


    def _thought(self, text: str, timed: dict) -> list[bytes]:
        """The events for a piece of the model's reasoning: a reasoning item opened first, if none is."""
        out: list[bytes] = []
        if self.thought is None:
            out += self._close()
            index = len(self.output)
            self.thought_id = _new_id("rs")
            out += [self._event("response.output_item.added", output_index=index,
                                item=_reasoning_item(self.thought_id, "", "in_progress")),
                    self._event("response.content_part.added", item_id=self.thought_id, output_index=index,
                                content_index=0, part=_reasoning_part(""))]
            self.thought = ""
        self.thought += text
        out.append(self._event("response.reasoning_text.delta", item_id=self.thought_id, output_index=len(self.output),
                               content_index=0, delta=text, **timed))
        return out


class ResponsesAdapter(ResponseStream):
    """OpenAI's Responses API on the chat shape (app.protocols.adapter's interface); its stream is a ResponseStream."""

    stream_mimetype = "text/event-stream"

    def __init__(self, body: dict):
        super().__init__(_new_id("resp"), body, body.get("model"))

    def to_openai(self) -> dict:
        """The Responses request as a chat request, its model as the client named it."""
        return {**to_chat(self.body), "model": self.body.get("model")}

    def answer(self, completion: dict) -> dict:
        """A chat completion as a `response`."""
        return to_response(completion, self.body, self.resp_id)

    def end(self) -> list[bytes]:
        """Nothing after response.completed; response.failed when the chat stream stopped before its finish."""
        if self.ended:
            return []
        if self.finished:
            return self.complete({})  # finished, and no usage came
        return self.feed({"error": {"code": "server_error", "message": "the answer ended before it was complete"}})

    def error(self, err: ApiError) -> tuple[int, dict]:
        """OpenAI's error shape, as on /v1."""
        return err.status, err.body()
