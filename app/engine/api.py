"""Request bodies of the runner's OpenAI-style endpoints, validated with pydantic."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from app.engine.request import SamplingParams

MAX_STOP_STRINGS = 8

NonNegInt = Annotated[int, Field(ge=0)]
INT32_MAX = 2**31 - 1  # llama.cpp takes top_k as a C int

# OpenAI parameters Hearth cannot honour, with the values that ask for nothing (those pass): ignoring
# a request for tools, JSON mode or log-probabilities would answer a different question than asked.
UNSUPPORTED = {
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
}


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        err_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON body of the error response."""
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


class UnsupportedParameter(ValueError):
    """A request parameter Hearth does not implement, set to a value that asks for it."""

    def __init__(self, name: str):
        super().__init__(f"'{name}' is not supported by Hearth; remove it from the request")
        self.name = name


class _Body(BaseModel):
    # Unknown fields are ignored: OpenAI clients send extras (user, logit_bias, ...) that a stock
    # llama-server ignores too.
    model_config = ConfigDict(extra="ignore", strict=False)

    model: str | None = None
    stream: bool = False
    stream_options: dict | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.8, ge=0.0, le=2.0)
    top_k: int = Field(default=40, ge=0, le=INT32_MAX)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    repeat_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    repeat_last_n: int = Field(default=64, ge=-1)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1, description="only one choice per request is supported")
    ignore_eos: bool = False
    # llama-server's: false computes the whole prompt and leaves nothing in the prefix cache.
    cache_prompt: bool = True
    # Hearth's extras: a stock llama-server ignores them.
    priority: int = Field(default=0, ge=-1000, le=1000)
    hearth_class: str = Field(default="default", min_length=1, max_length=64)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name, harmless in UNSUPPORTED.items():
                if name in data and not any(data[name] == h and type(data[name]) is type(h) for h in harmless):
                    raise UnsupportedParameter(name)
        return data

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return v

    def stops(self) -> tuple[str, ...]:
        """Stop strings as a tuple."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        """Engine sampling settings from this body."""
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            repeat_penalty=self.repeat_penalty,
            repeat_last_n=self.repeat_last_n,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            stop=self.stops(),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk (OpenAI's stream_options)."""
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionBody(_Body):
    """POST /v1/completions."""

    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class TextPart(BaseModel):
    """A text part of a message's content."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatBody(_Body):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        """As for completions; max_completion_tokens wins over max_tokens, as in OpenAI's API."""
        params = super().sampling(default_max_tokens)
        if self.max_completion_tokens is not None:
            params = SamplingParams(**{**params.__dict__, "max_tokens": self.max_completion_tokens})
        return params


class TokenizeBody(BaseModel):
    """POST /tokenize (llama-server's shape)."""

    model_config = ConfigDict(extra="ignore")
    content: str
    add_special: bool = False


class DetokenizeBody(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="ignore")
    tokens: list[Annotated[int, Field(ge=0)]]


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_field(part) -> bool:
    """True for the parts of a pydantic error location that name a field or an index (not union tags)."""
    if isinstance(part, int):
        return True
    return part.isidentifier() and part.islower() and part not in _UNION_TAGS


MAX_BODY_BYTES = 4 * 1024 * 1024


def too_large() -> ApiError:
    """413 for a body over MAX_BODY_BYTES."""
    return ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="body_too_large")


def parse_body(raw: bytes, schema: type[BaseModel]) -> tuple[BaseModel, dict]:
    """A request body validated by schema, and the raw JSON object; every failure is a clear 400."""
    if len(raw) > MAX_BODY_BYTES:
        raise too_large()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {exc.start})", code="invalid_utf8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                       code="invalid_json")
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate(data), data
    except ValidationError as exc:
        raise validation_error(exc)


def validation_error(exc: ValidationError) -> ApiError:
    """A 400 naming the offending field and what is wrong with it."""
    errors = exc.errors()
    unsupported = next((e for e in errors if isinstance(e.get("ctx", {}).get("error"), UnsupportedParameter)), None)
    if unsupported is not None:
        name = unsupported["ctx"]["error"].name
        return ApiError(400, str(unsupported["ctx"]["error"]), param=name, code="unsupported_parameter")
    # Of a union's alternatives, the deepest error says most (an image part fails on its 'type',
    # not on "content should be a string").
    first = max(errors, key=lambda e: sum(1 for p in e["loc"] if _is_field(p)))
    loc = ".".join(str(p) for p in first["loc"] if _is_field(p))
    msg = first["msg"]
    if first["type"] == "missing":
        message = f"'{loc}' is required"
    elif first["type"] == "literal_error" and loc.endswith("role"):
        message = f"'{loc}': unknown role; use one of system, developer, user, assistant, tool"
    elif loc == "n":
        message = f"'n': {msg}; only one choice per request is supported"
    else:
        message = f"'{loc}': {msg}"
    return ApiError(400, message, param=loc or None)
