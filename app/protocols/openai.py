"""Request bodies of the runner's OpenAI-style endpoints, validated with pydantic."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from app.protocols.body import load_object
from app.protocols.errors import ApiError
from app.schema_subset import (
    GrammarTooLarge,
    InvalidGrammar,
    SchemaSize,
    UnsupportedSchema,
    check_gbnf,
    check_schema_total,
    measure_schema,
    normalise_schema,
)

MAX_STOP_STRINGS = 8
# A stop string is matched against the text as it grows, and up to its length is held back from a
# stream while it might be starting: chat templates' end markers and "\nUser:" are under 30 characters.
MAX_STOP_CHARS = 1000
# logit_bias: OpenAI accepts at most 300 entries, each a bias from -100 to 100; a text key (llama-server's
# form) biases each of its tokens, so its length is bounded as a stop string's is.
MAX_LOGIT_BIAS = 300
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_LOGIT_BIAS_TEXT_CHARS = MAX_STOP_CHARS
MAX_CHOICES = 8  # `n`: each choice is a sequence of its own, generated side by side
MAX_TOP_LOGPROBS = 20
MAX_TOOLS = 128
# What a request can use beyond plain generation: recorded per request, counted per class on /metrics.
FEATURES = ("tools", "json_object", "json_schema", "fim", "logprobs")
# Fill-in-the-middle requests go to this class unless the client names one.
FIM_CLASS = "coding"

NonNegInt = Annotated[int, Field(ge=0)]
INT32_MAX = 2**31 - 1  # llama.cpp takes top_k as a C int

# OpenAI parameters Hearth cannot honour, with the values that ask for nothing (those pass): ignoring
# them would answer a different question than asked.
UNSUPPORTED = {
    "best_of": (None, 1),
    "echo": (None, False),
}


class UnsupportedParameter(ValueError):
    """A request parameter Hearth does not implement, set to a value that asks for it."""

    def __init__(self, name: str):
        super().__init__(f"'{name}' is not supported by Hearth; remove it from the request")
        self.name = name


class BodyProblem(ValueError):
    """A request that is well-formed field by field but inconsistent as a whole; names the field to fix."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


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
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, description=f"choices per request (at most {MAX_CHOICES})")
    ignore_eos: bool = False
    # llama-server's: false computes the whole prompt and leaves nothing in the prefix cache.
    cache_prompt: bool = True
    # llama-server's: a streamed prompt_progress object before the prompt and after each of its batches.
    return_progress: bool = False
    # llama-server's: the whole answer carries __verbose (the prompt as rendered, the content).
    verbose: bool = False
    # llama-server's: every streamed piece carries the timings so far.
    timings_per_token: bool = False
    # llama-server's name for max_tokens (-1: no limit but the context).
    n_predict: int | None = Field(default=None, ge=-1)
    # {token id or text: bias} (OpenAI), or llama-server's [[token id or text, bias or false], ...].
    logit_bias: dict[str, float | bool] | list[list] | None = None
    # llama-server's "speculative.n_max": draft tokens per iteration at most for this request (0: no drafts).
    speculative_n_max: int | None = Field(default=None, ge=0, le=1024, alias="speculative.n_max")
    # Hearth's extras: a stock llama-server ignores them.
    priority: int = Field(default=0, ge=-1000, le=1000)
    hearth_class: str = Field(default="default", min_length=1, max_length=64)
    # Set by the gateway, whatever the client sent: the member the request is for, whose KV disk-tier entries
    # are removed with them, and whether the class is private (its prompts never written to the disk tier).
    hearth_member: str | None = Field(default=None, max_length=300)
    hearth_private: bool = False

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
        longest = max((len(x) for x in ([v] if isinstance(v, str) else v or [])), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string is at most {MAX_STOP_CHARS:,} characters long (one here is {longest:,})")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v):
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries are allowed (this one has {len(v):,})")
        for pair in (v.items() if isinstance(v, dict) else v):
            if len(pair) != 2:
                raise ValueError("each entry is [token, bias]")
            key, bias = pair
            if isinstance(key, bool) or not isinstance(key, str | int):
                raise ValueError("a token is a token id or a text")
            if isinstance(key, str) and len(key) > MAX_LOGIT_BIAS_TEXT_CHARS:
                raise ValueError(f"a text key is at most {MAX_LOGIT_BIAS_TEXT_CHARS:,} characters long")
            if isinstance(key, int) and not 0 <= key < 2**31:
                raise ValueError(f"token id {key} is outside any vocabulary")
            if bias is False:
                continue  # llama-server's: the token is never chosen
            if isinstance(bias, bool) or not isinstance(bias, int | float) or not (
                    -MAX_LOGIT_BIAS_VALUE <= bias <= MAX_LOGIT_BIAS_VALUE):
                raise ValueError(f"a bias is a number from -{MAX_LOGIT_BIAS_VALUE:g} to {MAX_LOGIT_BIAS_VALUE:g} "
                                 f"(or false), not {bias!r}")
        return v

    def stops(self) -> tuple[str, ...]:
        """Stop strings as a tuple."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def requested_max_tokens(self) -> int | None:
        """The client's limit on generated tokens: max_tokens, else n_predict (None: none named)."""
        if self.max_tokens is not None:
            return self.max_tokens
        return self.n_predict if self.n_predict is not None and self.n_predict > 0 else None


    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk (OpenAI's stream_options)."""
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionBody(_Body):
    """POST /v1/completions."""

    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    # Fill-in-the-middle: the text after the gap; the prompt is the text before it.
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def fim(self) -> bool:
        """True when the request fills in the middle (a non-empty suffix)."""
        return bool(self.suffix)

    @property
    def features(self) -> tuple[str, ...]:
        """What beyond plain completion this request uses (FEATURES)."""
        return tuple(f for f, used in (("fim", self.fim), ("logprobs", self.logprobs is not None)) if used)


class NativeCompletionBody(_Body):
    """POST /completion and /completions: llama-server's own completion request."""

    # Text, token ids (text may be mixed in), several prompts, or {"prompt_string", "multimodal_data"}.
    prompt: str | list | dict
    n_probs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    post_sampling_probs: bool = False
    return_tokens: bool = False
    grammar: str | None = None
    json_schema: dict | None = None
    id_slot: int = -1
    response_fields: list[str] | None = None
    # llama-server streams unless told otherwise only where the client asks; same default here.
    stream: bool = False

    @field_validator("json_schema")
    @classmethod
    def _check_schema(cls, v):
        if v is not None:
            normalise_schema(v, "json_schema")
        return v

    @field_validator("grammar")
    @classmethod
    def _check_grammar(cls, v):
        if v:
            check_gbnf(v)
        return v

    @property
    def features(self) -> tuple[str, ...]:
        """What beyond plain completion this request uses (FEATURES)."""
        return tuple(f for f, used in (("json_schema", self.json_schema is not None),
                                       ("logprobs", self.n_probs > 0)) if used)


class ExtraChunk(BaseModel):
    """One file of context for /infill (llama-server's input_extra)."""

    model_config = ConfigDict(extra="ignore")
    filename: str = ""
    text: str = ""


class InfillBody(_Body):
    """POST /infill (llama-server's code-completion endpoint)."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list, max_length=64)
    # Text placed after the middle marker (llama-server's meaning), e.g. the start of the line.
    prompt: str = ""
    n_probs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def features(self) -> tuple[str, ...]:
        """Always fill-in-the-middle."""
        return ("fim",)


class TextPart(BaseModel):
    """A text part of a message's content."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    """An image_url part's image: a base64 data URL (or an http(s) URL, fetched only where the runner allows)."""

    model_config = ConfigDict(extra="ignore")
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    """An image part of a message's content (vision models: the runner's --mmproj)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(BaseModel):
    """An input_audio part's audio: the file as base64 and its format."""

    model_config = ConfigDict(extra="ignore")
    data: str
    format: str


class AudioPart(BaseModel):
    """An audio part of a message's content (audio models: a projector with an audio encoder)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[TextPart | ImagePart | AudioPart, Field(discriminator="type")]


def content_parts(messages, types: tuple[str, ...]) -> list[tuple[dict, str]]:
    """(part, where) of every content part of one of `types`, in prompt order; where is the part's path in the body
    (messages.I.content.J). Messages or contents that are not what OpenAI's shape says are passed over."""
    return [(part, f"messages.{i}.content.{j}")
            for i, m in enumerate(messages if isinstance(messages, list) else ()) if isinstance(m, dict)
            for j, part in enumerate(m.get("content") if isinstance(m.get("content"), list) else ())
            if isinstance(part, dict) and part.get("type") in types]


def audio_part(data: str, fmt: str) -> dict:
    """An OpenAI input_audio content part: what the other APIs' audio is translated to."""
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def image_part(url: str) -> dict:
    """An OpenAI image_url content part: what the other APIs' images are translated to."""
    return {"type": "image_url", "image_url": {"url": url}}


class FunctionCallIn(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(BaseModel):
    """An assistant message's tool_calls[] entry."""

    model_config = ConfigDict(extra="ignore")
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class Message(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    # The deprecated form of tool_calls in older clients' histories: it lets an assistant message
    # omit its content, as OpenAI allows.
    function_call: dict | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # An assistant turn's reasoning, as llama-server takes it: templates that show past reasoning (Qwen3) render it.
    reasoning_content: str | None = None


class FunctionDef(BaseModel):
    """A tool's function: name, description and a JSON Schema of its arguments."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, v):
        if v is not None:
            normalise_schema(v, "parameters")
        return v


class Tool(BaseModel):
    """One entry of `tools`."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    """The function of a named tool_choice."""

    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming one function."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _check_schema(cls, v):
        normalise_schema(v, "schema")
        return v


class ResponseFormat(BaseModel):
    """response_format: text, JSON mode, or JSON valid against a schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # llama-server's extension: json_object with a schema is json_schema.
    schema_: dict | None = Field(default=None, alias="schema")

    @field_validator("schema_")
    @classmethod
    def _check_schema(cls, v):
        if v is not None:
            normalise_schema(v, "schema")
        return v

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object with a schema")
        return self


class ChatBody(_Body):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # llama-server's constraints beside response_format: GBNF text, or a JSON Schema.
    grammar: str | None = None
    json_schema: dict | None = None
    # Extra template variables (e.g. enable_thinking), as llama-server and vLLM take them.
    chat_template_kwargs: dict | None = None
    # A final assistant message is continued, not answered (llama-server's prefill, vLLM's names).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Reasoning, in llama-server's names: "none" leaves the thoughts in content, the others split them into
    # reasoning_content; OpenAI's effort ("none" turns thinking off, the others reach templates that read it);
    # a budget of thinking tokens (-1: the runner's default, 0: no thinking), under either of its two names.
    reasoning_format: Literal["none", "auto", "deepseek", "deepseek-legacy"] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    reasoning_budget_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    thinking_budget_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)

    @field_validator("json_schema")
    @classmethod
    def _check_json_schema(cls, v):
        if v is not None:
            normalise_schema(v, "json_schema")
        return v

    @field_validator("grammar")
    @classmethod
    def _check_grammar(cls, v):
        if v:
            check_gbnf(v)
        return v

    @model_validator(mode="after")
    def _check_tools_together(self):
        # The offered tools become one grammar: their schemas are bounded together as one schema is.
        total = SchemaSize()
        for tool in self.tools or ():
            if tool.function.parameters is not None:
                total.add(measure_schema(tool.function.parameters, "parameters"))
        check_schema_total(total, "tools")
        return self

    @model_validator(mode="before")
    @classmethod
    def _map_legacy_functions(cls, data):
        # The deprecated `functions`/`function_call` pair is the same request in older clients' words.
        if isinstance(data, dict) and ("functions" in data or "function_call" in data):
            data = dict(data)
            functions = data.pop("functions", None)
            call = data.pop("function_call", None)
            if functions is not None and not isinstance(functions, list):
                raise BodyProblem("functions", "'functions' must be a list of function definitions "
                                               f"(got {type(functions).__name__}); 'tools' is its current name")
            if functions and "tools" not in data:
                data["tools"] = [{"type": "function", "function": f} for f in functions]
            if call is not None and "tool_choice" not in data:
                data["tool_choice"] = {"type": "function", "function": call} if isinstance(call, dict) else call
        return data

    @model_validator(mode="after")
    def _check_contents(self):
        # OpenAI's rule: every message has content, except an assistant message that calls tools.
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and (m.tool_calls or m.function_call)):
                why = " (an assistant message may omit it only when it has tool_calls)" if m.role == "assistant" else ""
                raise BodyProblem("messages", f"'messages.{i}.content' is required in a {m.role} message{why}")
        roles = [m.role for m in self.messages[-2:]]
        if roles == ["assistant", "assistant"] and self.prefill:
            # Which one would be continued? llama-server refuses it too.
            raise BodyProblem("messages", "'messages': two assistant messages end the list; merge them into one "
                                          "to continue it")
        return self

    @model_validator(mode="after")
    def _check_tool_choice(self):
        names = [t.function.name for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise BodyProblem("tool_choice", f"'tool_choice' names '{self.tool_choice.function.name}', "
                                             f"which is not among the tools ({', '.join(names) or 'none'})")
        if self.tool_choice == "required" and not names:
            raise BodyProblem("tool_choice", "'tool_choice': 'required' needs at least one tool in 'tools'")
        if len(set(names)) != len(names):
            raise BodyProblem("tools", "'tools': function names must be unique")
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise BodyProblem("continue_final_message", "'continue_final_message' and 'add_generation_prompt' "
                                                        "cannot both be true")
        return self

    @property
    def reasoning_budget(self) -> int:
        """The thinking budget in tokens: -1 for the runner's default (either name; the first given wins)."""
        for v in (self.reasoning_budget_tokens, self.thinking_budget_tokens):
            if v is not None and v != -1:
                return v
        return -1

    @property
    def prefill(self) -> bool:
        """Whether the final assistant message is continued (llama-server does so by default)."""
        return self.messages[-1].role == "assistant" and (self.continue_final_message or self.add_generation_prompt)

    @property
    def tool_list(self) -> list[dict]:
        """The offered tools as plain OpenAI dicts ([] when tool_choice is none)."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def choice(self):
        """tool_choice as a plain value: "auto" (default with tools), "none", "required" or a named dict."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"

    @property
    def features(self) -> tuple[str, ...]:
        """What beyond plain chat this request uses (tools, json_object, json_schema, logprobs)."""
        out = []
        if self.tool_list:
            out.append("tools")
        if self.response_format is not None and self.response_format.type != "text":
            out.append(self.response_format.type)
        if self.logprobs:
            out.append("logprobs")
        return tuple(out)



MAX_EMBEDDING_INPUTS = 2048  # OpenAI's own limit per request


class EmbeddingBody(BaseModel):
    """POST /v1/embeddings (OpenAI's shape, plus Ollama's truncate)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: (Annotated[str, Field(min_length=1)]
            | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
            | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
            | Annotated[list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
                        Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    truncate: bool = True
    # The gateway's path is shared with generation: an embedding streams nothing, and the class's
    # max_tokens the gateway forwards is ignored (no token is generated).
    stream: Literal[False] = False
    max_tokens: int | None = None
    priority: int = Field(default=0, ge=-1000, le=1000)
    hearth_class: str = Field(default="default", min_length=1, max_length=64)

    @property
    def features(self) -> tuple[str, ...]:
        """What beyond plain chat this request uses: nothing (embeddings are their own route)."""
        return ()

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list: texts or token lists."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [list(self.input)]
        return list(self.input)


class ApplyTemplateBody(ChatBody):
    """POST /apply-template: a chat request's body, rendered but not generated (llama-server reads the whole body:
    messages, tools, tool_choice, chat_template_kwargs, reasoning_effort, add_generation_prompt...)."""


class TokenizeBody(BaseModel):
    """POST /tokenize (llama-server's shape)."""

    model_config = ConfigDict(extra="ignore")
    content: str
    add_special: bool = False
    with_pieces: bool = False
    parse_special: bool = True


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
# The largest image a request may send (the runner's default --image-max-bytes): a phone's photo as it was taken.
MAX_IMAGE_BYTES = 20 * 1024 * 1024
# A generation's body may hold one image at that limit as base64 (4 bytes for every 3) beside MAX_BODY_BYTES of
# text: 27,962,028 + 4,194,304 = 32,156,332 bytes. Without it a 3 MiB photo was a generic 413 before the image
# limit was ever looked at. Other routes keep MAX_BODY_BYTES, and a body over either limit is refused by its
# Content-Length before a byte of it is read.
MAX_GENERATION_BODY_BYTES = MAX_BODY_BYTES + 4 * -(-MAX_IMAGE_BYTES // 3)
# The routes that generate (gateway and runner, every API): the ones that take images.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
                              "/completion", "/v1/messages", "/v1/responses", "/api/chat", "/api/generate",
                              "/v1/audio/transcriptions", "/audio/transcriptions"})


def body_limit(path: str) -> int:
    """The largest body a route takes: generations make room for an image."""
    return MAX_GENERATION_BODY_BYTES if path in GENERATION_PATHS else MAX_BODY_BYTES


def too_large(limit: int = MAX_BODY_BYTES) -> ApiError:
    """413 for a body over its route's limit, naming it."""
    if limit == MAX_GENERATION_BODY_BYTES:
        hint = (f" (room for one image of up to {MAX_IMAGE_BYTES:,} bytes as base64 beside the text): send images "
                "smaller (scaled down or recompressed), or fewer in one request")
    else:
        hint = ": send less"
    return ApiError(413, f"the request body is larger than the limit of {limit:,} bytes{hint}", code="body_too_large")


def parse_body(raw: bytes, schema: type[BaseModel], max_bytes: int = MAX_BODY_BYTES) -> tuple[BaseModel, dict]:
    """A request body validated by schema, and the raw JSON object; every failure is a clear 400 (413 when it is
    over max_bytes)."""
    if len(raw) > max_bytes:
        raise too_large(max_bytes)
    data = load_object(raw)
    try:
        return schema.model_validate(data), data
    except ValidationError as exc:
        raise validation_error(exc)


def validation_error(exc: ValidationError) -> ApiError:
    """A 400 naming the offending field and what is wrong with it."""
    errors = exc.errors()
    schema = next((e for e in errors if isinstance(e.get("ctx", {}).get("error"),
                                                   UnsupportedSchema | GrammarTooLarge | InvalidGrammar)), None)
    if schema is not None:
        error = schema["ctx"]["error"]
        # A bound over several fields (the tools together) is raised for the whole body: its path names them.
        loc = (".".join(str(p) for p in schema["loc"] if _is_field(p) or p == "schema").replace("schema_", "schema")
               or getattr(error, "path", ""))
        return ApiError(400, f"'{loc}': {error}", param=loc.split(".")[0] or None, code=error.code)
    problem = next((e for e in errors if isinstance(e.get("ctx", {}).get("error"), BodyProblem)), None)
    if problem is not None:
        return ApiError(400, str(problem["ctx"]["error"]), param=problem["ctx"]["error"].param)
    unsupported = next((e for e in errors if isinstance(e.get("ctx", {}).get("error"), UnsupportedParameter)), None)
    if unsupported is not None:
        name = unsupported["ctx"]["error"].name
        return ApiError(400, str(unsupported["ctx"]["error"]), param=name, code="unsupported_parameter")
    # Of a union's alternatives, the deepest error says most (an image part fails on its 'type',
    # not on "content should be a string").
    first = max(errors, key=lambda e: sum(1 for p in e["loc"] if _is_field(p)))
    loc = ".".join(str(p) for p in first["loc"] if _is_field(p))
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = f"'{loc}' is required"
    elif first["type"] == "literal_error" and loc.endswith("role"):
        message = f"'{loc}': unknown role; use one of system, developer, user, assistant, tool"
    elif loc == "n":
        message = f"'n': {msg}; at most {MAX_CHOICES} choices per request"
    else:
        message = f"'{loc}': {msg}"
    return ApiError(400, message, param=loc or None)
