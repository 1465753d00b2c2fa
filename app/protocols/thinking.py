"""Thinking controls in OpenAI's chat shape (contract C2), the one vocabulary every API adapter and the
gateway's class default write: a request turns a model's thinking off, on, or leaves it to the model.

Off is `chat_template_kwargs.enable_thinking: false` (templates such as Qwen3's render thinking off)
and `reasoning_effort: "none"` (the runner's C3 reads it where a template has no switch); on is
`enable_thinking: true`, with an effort (gpt-oss's templates read `reasoning_effort`) or a budget of
thinking tokens (`thinking_budget_tokens`, llama-server's name) when the client gave one. The answer's
thoughts come back as `reasoning_content`; where a client turned thinking off, its adapter drops any
the model produced anyway, so they reach neither the client nor, spoken, a room.
"""

from __future__ import annotations

from typing import Any

from app.policy import THINKING_MODES
from app.protocols.openai import ApiError

# OpenAI's reasoning_effort values that ChatBody takes; "none" turns thinking off.
EFFORTS = ("none", "minimal", "low", "medium", "high")
EFFORT_OFF = "none"
# A request class's thinking default: the model's own, off, on.
THINKING_MODEL, THINKING_OFF, THINKING_ON = THINKING_MODES
# The fields by which an OpenAI chat request says something about thinking itself.
_REQUEST_FIELDS = ("reasoning_effort", "reasoning_budget_tokens", "thinking_budget_tokens")


def thinking_off() -> dict:
    """The chat fields that turn thinking off."""
    return {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": EFFORT_OFF}


def thinking_on(effort: str | None = None, budget_tokens: int | None = None) -> dict:
    """The chat fields that turn thinking on, with an effort level and a budget of thinking tokens if given."""
    out: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": True}}
    if effort is not None:
        out["reasoning_effort"] = effort
    if budget_tokens is not None:
        out["thinking_budget_tokens"] = budget_tokens
    return out


def with_thinking(chat: dict, fields: dict) -> dict:
    """`chat` with thinking fields added; chat_template_kwargs are merged, the client's own keys kept."""
    out = {**chat, **{k: v for k, v in fields.items() if k != "chat_template_kwargs"}}
    if "chat_template_kwargs" in fields:
        out["chat_template_kwargs"] = {**fields["chat_template_kwargs"], **(chat.get("chat_template_kwargs") or {})}
    return out


def says_thinking(chat: dict) -> bool:
    """Whether an OpenAI chat request decides thinking itself (its own field wins over a class default)."""
    kwargs = chat.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and "enable_thinking" in kwargs:
        return True
    return any(chat.get(f) is not None for f in _REQUEST_FIELDS)


def class_thinking(mode: str) -> dict:
    """The chat fields of a class's thinking default (none for "model")."""
    if mode == THINKING_OFF:
        return thinking_off()
    if mode == THINKING_ON:
        return thinking_on()
    return {}


def effort(value: Any, param: str) -> str:
    """An effort level as reasoning_effort takes it; 400 naming `param` for anything else."""
    if value not in EFFORTS:
        raise ApiError(400, f"'{param}' must be one of {', '.join(EFFORTS)} (got {value!r})", param=param)
    return value


def reasoning_tokens(usage: dict | None) -> int:
    """The thinking tokens of an OpenAI usage (completion_tokens_details.reasoning_tokens), 0 when absent."""
    details = (usage or {}).get("completion_tokens_details") or {}
    value = details.get("reasoning_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
