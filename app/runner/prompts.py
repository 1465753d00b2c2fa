"""Prompts as tokens: the one chat prompt (chat, its input_tokens, Anthropic's count_tokens, Responses' input_tokens),
text and token prompts, llama-server's several native prompts, fill-in-the-middle.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from app.engine import tools as toolfmt
from app.engine.chat import ChatTemplateError, strip_leading_bos
from app.protocols.openai import ApiError, ChatBody
from app.runner.state import RunnerState


class ChatPrompt(NamedTuple):
    """A chat request's prompt tokens, the tools it offers and its rendered text (after the BOS strip)."""

    tokens: list[int]
    tools: list[dict]
    text: str


def render(state: RunnerState, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
           kwargs: dict | None = None) -> str:
    """Messages through the chat template, with llama.cpp's template variables."""
    # As llama.cpp renders templates: thinking on unless --reasoning off, today's date_string (Llama 3.x
    # templates print it); a request's own chat_template_kwargs win.
    defaults = {"enable_thinking": state.config.reasoning != "off", "date_string": time.strftime("%d %b %Y")}
    try:
        return state.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     kwargs={**defaults, **(kwargs or {})})
    except ChatTemplateError as exc:
        raise ApiError(400, f"'messages': {exc}", param="messages", code="chat_template")


def request_thinking(state: RunnerState, body: ChatBody) -> bool:
    """Whether a chat request thinks: its chat_template_kwargs.enable_thinking, else reasoning_effort "none" (off),
    else the runner's --reasoning."""
    asked = (body.chat_template_kwargs or {}).get("enable_thinking")
    if isinstance(asked, bool):
        return asked
    if body.reasoning_effort == "none":
        return False
    return state.config.reasoning != "off"


def template_kwargs(body: ChatBody, thinking: bool) -> dict:
    """The template variables a chat request adds: its chat_template_kwargs, enable_thinking and reasoning_effort."""
    kwargs = {**(body.chat_template_kwargs or {}), "enable_thinking": thinking}
    # As llama-server: an effort other than "none" reaches the template (gpt-oss reads it).
    if body.reasoning_effort and body.reasoning_effort != "none":
        kwargs["reasoning_effort"] = body.reasoning_effort
    return kwargs


def chat_prompt(state: RunnerState, body: ChatBody, *, thinking: bool | None = None) -> ChatPrompt:
    """The prompt of a chat request, as generation and every token count build it.

    thinking None: as the request asks (request_thinking); True/False: the caller's choice."""
    if thinking is None:
        thinking = request_thinking(state, body)
    kwargs = template_kwargs(body, thinking)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    tools = body.tool_list
    fmt = state.tool_format
    messages = toolfmt.prepare_messages(messages, fmt, tools, body.choice, body.parallel_tool_calls)
    native_tools = tools if tools and fmt != toolfmt.GENERIC else None
    if body.prefill and not tools:
        text = _continue_final(state, messages, native_tools, kwargs)
    else:
        text = render(state, messages, body.add_generation_prompt, native_tools, kwargs)
    text, _ = strip_leading_bos(text, state.template.bos_token)
    return ChatPrompt(state.model.tokenize(text, add_special=True, parse_special=True), tools, text)


def _continue_final(state: RunnerState, messages: list[dict], tools, kwargs) -> str:
    """The prompt that continues the final assistant message: rendered, then cut after its text."""
    content = messages[-1].get("content")
    if isinstance(content, list):
        # The continued message's text parts are joined by a blank line, as llama-server continues them.
        content = "\n\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        messages = [*messages[:-1], {**messages[-1], "content": content}]
    text = render(state, messages, False, tools, kwargs)
    cut = text.rfind(content.rstrip()) if content and content.strip() else -1
    return text[: cut + len(content.rstrip())] if cut >= 0 else text


def prompt_tokens(model, prompt, param: str) -> list[int]:
    """One prompt as tokens: text (BOS added, special tokens parsed) or ids, which may mix in text."""
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


def native_prompts(model, prompt) -> list[list[int]]:
    """llama-server's prompt forms: text, ids (mixed with text), a list of those, or {"prompt_string"}."""
    if isinstance(prompt, dict):
        if prompt.get("multimodal_data"):
            raise ApiError(400, "'prompt': multimodal data is not supported by this model", param="prompt",
                           code="multimodal_unsupported")
        text = prompt.get("prompt_string")
        if not isinstance(text, str):
            raise ApiError(400, "'prompt.prompt_string' must be text", param="prompt")
        return [prompt_tokens(model, text, "prompt")]
    if isinstance(prompt, str):
        return [prompt_tokens(model, prompt, "prompt")]
    if not prompt:
        raise ApiError(400, "'prompt' is empty", param="prompt")
    if any(isinstance(p, int) for p in prompt):
        return [prompt_tokens(model, prompt, "prompt")]
    return [prompt_tokens(model, p if isinstance(p, (str, list)) else [p], "prompt") for p in prompt]


def fim_tokens(model, prefix: str | None, suffix: str, extra: list, after: str, param: str) -> list[int]:
    """A fill-in-the-middle prompt in the model's own FIM tokens (prefix, suffix, middle)."""
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


def detokenize(model, tokens) -> str:
    """Tokens back to text (a broken character as U+FFFD)."""
    return b"".join(model.token_bytes(t) for t in tokens).decode("utf-8", "replace")
