"""A chat template's inputs as llama.cpp builds them (common/chat.cpp), so a template renders here as it does there.

llama-server turns OpenAI messages into its own message type and back into JSON before rendering
(`to_json_oaicompat`): fixed key order, content "" where there was none, arguments as the text the client
sent; then its `workaround::` functions adapt them to what the template supports (developer -> system, a
system message folded into the next turn, arguments as objects). The variables beside the messages are
llama.cpp's too: tools only when there are some, add_generation_prompt only when true, today's date.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime

from app.engine.template_caps import TemplateCaps, preserve_reasoning_vars

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# The part an image becomes before rendering (llama.cpp's name): its text is the projector's media marker.
MEDIA_MARKER = "media_marker"
# Harmony (gpt-oss) templates know the developer role; llama.cpp maps it to system for every other one.
_HARMONY_MARK = "<|channel|>"
# StepFun's templates: llama.cpp trims every content first (leftover whitespace sends the model into loops).
_STEPFUN_MARK = "You have access to the following functions in JSONSchema format"


class TemplateInputError(ValueError):
    """Messages that cannot be given to a template; the message says what to fix."""


def template_messages(messages: list[dict], caps: TemplateCaps, source: str) -> list[dict]:
    """OpenAI-style messages as llama.cpp hands them to this template."""
    if not isinstance(messages, list) or not messages:
        raise TemplateInputError("messages must be a non-empty list of {role, content} objects")
    trim = _STEPFUN_MARK in source
    out = [_message(m, i, caps, trim) for i, m in enumerate(messages)]
    if _HARMONY_MARK not in source:
        out = [{**m, "role": "system"} if m["role"] == "developer" else m for m in out]
    if not caps.supports_system_role:
        out = _fold_system(out)
    if caps.supports_object_arguments:
        out = [_object_arguments(m) for m in out]
    if _is_ministral_3(source):
        out = [_ministral_blocks(m) for m in out]
    elif _is_lfm2(source):
        # LFM2 / LFM2.5 read an earlier turn's reasoning as `thinking` (llama.cpp's handler copies it there).
        out = [{**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m for m in out]
    elif _GEMMA4_MARK in source and _GEMMA4_CURRENT not in source:
        out = gemma4_model_turns(out)
    return out


# Gemma 4's templates; the current ones (with the OpenAI note) take tool results as they come, older ones want
# them folded into the calling model turn, as llama.cpp's workaround does.
_GEMMA4_MARK = "'<|tool_call>call:'"
_GEMMA4_CURRENT = "{#- OpenAI Chat Completions:"


def _is_lfm2(source: str) -> bool:
    """LFM2 (its tool-list markers) or LFM2.5 (a plain "List of tools: [") templates."""
    if "<|tool_list_start|>" in source and "<|tool_list_end|>" in source:
        return True
    return "List of tools: [" in source and "<|tool_list_start|>" not in source


def gemma4_model_turns(messages: list[dict]) -> list[dict]:
    """Each calling assistant turn with the tool results after it (and the answer that follows) as one model turn."""
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        if m["role"] != "assistant" or not m.get("tool_calls"):
            out.append(m)
            i += 1
            continue
        calls, responses = list(m["tool_calls"]), []
        i += 1
        while i < len(messages) and messages[i]["role"] == "tool":
            responses.append(_gemma4_response(messages[i], calls, len(responses)))
            i += 1
        turn: dict = {"role": "assistant", "tool_calls": calls}
        if responses:
            turn["tool_responses"] = responses
        if i < len(messages) and messages[i]["role"] == "assistant" and not messages[i].get("tool_calls") \
                and messages[i].get("content"):
            turn["content"] = messages[i]["content"]
            i += 1
        if isinstance(m.get("reasoning_content"), str):
            turn["reasoning_content"] = m["reasoning_content"]
        out.append(turn)
    return out


def _gemma4_response(message: dict, calls: list[dict], index: int) -> dict:
    """A tool result as Gemma 4's model turn lists it: the calling function's name and the result (as JSON if it is)."""
    content = message.get("content")
    response = content
    if isinstance(content, str):
        try:
            response = json.loads(content)
        except ValueError:
            response = content
    name = calls[index]["function"].get("name", "") if index < len(calls) else ""
    return {"name": name or message.get("tool_call_id", ""), "response": response}


def _is_ministral_3(source: str) -> bool:
    """Ministral 3 / Magistral's templates (llama.cpp's own handler for them; Mistral Small 3.2 has [CALL_ID])."""
    return all(mark in source for mark in ("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]")) and "[CALL_ID]" not in source


def _ministral_blocks(message: dict) -> dict:
    """A system or assistant message as Ministral 3's content blocks: its reasoning as a thinking block, then text."""
    if message["role"] not in ("system", "assistant"):
        return message
    blocks: list = []
    if isinstance(message.get("reasoning_content"), str):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"]})
    content = message.get("content")
    if isinstance(content, str):
        blocks.append({"type": "text", "text": content})
    elif isinstance(content, list):
        blocks.extend(content)
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    out["content"] = blocks
    return out


def _message(message, index: int, caps: TemplateCaps, trim: bool) -> dict:
    """One message in llama.cpp's JSON shape: role, content, reasoning_content, name, tool_call_id, tool_calls."""
    if not isinstance(message, Mapping):
        raise TemplateInputError(f"messages[{index}] must be an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise TemplateInputError(f"messages[{index}].role is {role!r}; use one of {', '.join(sorted(ROLES))}")
    out: dict = {"role": role, "content": _content(message.get("content"), index, caps, trim)}
    reasoning = message.get("reasoning_content")
    if reasoning:
        out["reasoning_content"] = reasoning.strip() if trim else reasoning
    for key in ("name", "tool_call_id"):
        if message.get(key):
            out[key] = message[key]
    if message.get("tool_calls"):
        out["tool_calls"] = [_call(c) for c in message["tool_calls"]]
    return out


def _content(content, index: int, caps: TemplateCaps, trim: bool):
    """A message's content: text ("" for none), or its text parts where the template reads typed content."""
    if content is None or content == "":
        return ""
    if isinstance(content, str):
        text = content.strip() if trim else content
        if caps.supports_typed_content and not caps.supports_string_content:
            return [{"type": "text", "text": text}]
        return text
    if not isinstance(content, list):
        raise TemplateInputError(f"messages[{index}].content must be a string or a list of text parts")
    parts = []
    for part_index, part in enumerate(content):
        where = f"messages[{index}].content[{part_index}]"
        if not isinstance(part, Mapping):
            raise TemplateInputError(f'{where} must be an object like {{"type": "text", "text": "..."}}')
        if part.get("type") == MEDIA_MARKER:
            parts.append({"type": MEDIA_MARKER, "text": str(part.get("text", ""))})
            continue
        if part.get("type") != "text":
            raise TemplateInputError(f"{where} has type {part.get('type')!r}; this server accepts text parts only")
        if not isinstance(part.get("text"), str):
            raise TemplateInputError(f"{where}.text must be a string")
        parts.append({"type": "text", "text": part["text"].strip() if trim else part["text"]})
    if not parts:
        return ""
    if any(p["type"] == MEDIA_MARKER for p in parts):
        return _join_with_media(parts)
    if caps.supports_string_content and not caps.supports_typed_content:
        # Newline-joined, as llama.cpp joins text parts for templates that take strings only.
        return "\n".join(p["text"] for p in parts)
    return parts


def _join_with_media(parts: list[dict]) -> str:
    """Parts with images as one text, as llama.cpp's common_chat_msg joins them: text parts newline-joined,
    no newline before or after an image's marker (the template then sees a string, whatever its caps)."""
    text = ""
    after_media = False
    for p in parts:
        if p["type"] == MEDIA_MARKER:
            after_media = True
        else:
            if not after_media and text:
                text += "\n"
            after_media = False
        text += p["text"]
    return text


def _call(call: Mapping) -> dict:
    """A tool call as llama.cpp keeps it: type, function {name, arguments as text}, id when there is one."""
    function = call.get("function") or {}
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        # llama.cpp keeps an object's compact dump (nlohmann's dump(): no spaces).
        arguments = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    out = {"type": "function", "function": {"name": function.get("name", ""), "arguments": arguments}}
    if call.get("id"):
        out["id"] = call["id"]
    return out


def _fold_system(messages: list[dict]) -> list[dict]:
    """A first system message folded into the next one (newline-joined), for templates without a system role."""
    if not messages or messages[0]["role"] != "system":
        return messages
    if len(messages) == 1:
        return []
    first, second = messages[0], messages[1]
    return [{**second, "content": f"{_text(first['content'])}\n{_text(second['content'])}"}, *messages[2:]]


def _text(content) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content)
    return content or ""


def _object_arguments(message: dict) -> dict:
    """A message's call arguments as JSON objects, for templates that read them as objects."""
    if "tool_calls" not in message:
        return message
    calls = []
    for call in message["tool_calls"]:
        arguments = call["function"]["arguments"]
        try:
            parsed = json.loads(arguments)
        except ValueError as exc:
            raise TemplateInputError(f"a tool call's arguments are not JSON ({exc}); send them as a JSON object")
        calls.append({**call, "function": {**call["function"], "arguments": parsed}})
    return {**message, "tool_calls": calls}


def template_tools(tools: list[dict] | None) -> list[dict] | None:
    """Tools as llama.cpp passes them: type, function {name, description ("" if none), parameters ({} if none)}."""
    if not tools:
        return None
    out = []
    for tool in tools:
        f = tool.get("function") or {}
        out.append({"type": "function", "function": {"name": f.get("name", ""),
                                                     "description": f.get("description") or "",
                                                     "parameters": f.get("parameters") or {}}})
    return out


def template_context(now: datetime, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                     bos_token: str, eos_token: str, kwargs: dict) -> dict:
    """Every variable a template is rendered with, as llama.cpp's common_chat_template_direct_apply sets them."""
    context: dict = {"messages": messages, "bos_token": bos_token, "eos_token": eos_token,
                     "enable_thinking": bool(kwargs.get("enable_thinking", True))}
    if tools:
        context["tools"] = tools
    context |= {"datetime": now.strftime("%b %d %Y"), "date_string": now.strftime("%d %b %Y"), **kwargs}
    if add_generation_prompt:
        # Only when true: a template may test `add_generation_prompt is defined`.
        context["add_generation_prompt"] = True
    if isinstance(context.get("preserve_reasoning"), bool):
        context |= preserve_reasoning_vars(context["preserve_reasoning"])
    effort = context.get("reasoning_effort")
    if isinstance(effort, str) and effort:
        context["reasoning_strength"] = effort
    return context
