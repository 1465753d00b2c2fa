"""Chat templates: turn OpenAI-style messages into the prompt text a model was trained on.

A GGUF usually carries its Jinja2 chat template in `tokenizer.chat_template`; it is rendered
the way Hugging Face transformers renders it (same sandbox, same helpers), so prompts match
what the model saw in training. Some GGUFs ship without one (the embedded Gemma 3 270M does):
for a known architecture Hearth supplies that family's format, otherwise a ChatML fallback.
"""

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from os import PathLike
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from app.gguf_meta import GgufMetadata

# Gemma 3 has no system role: a leading system message is folded into the first user turn,
# followed by a blank line. Turn contents are trimmed, as Google's reference template does.
GEMMA3_TEMPLATE = """\
{{- bos_token -}}
{%- set ns = namespace(prefix='') -%}
{%- set turns = messages -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set ns.prefix = messages[0].content ~ '\\n\\n' -%}
  {%- set turns = messages[1:] -%}
{%- endif -%}
{%- if not turns -%}
  {{- raise_exception('Gemma 3 needs at least one user message; '
                      ~ 'a system message alone is not a conversation') -}}
{%- endif -%}
{%- for message in turns -%}
  {%- set expected = 'user' if loop.index0 % 2 == 0 else 'assistant' -%}
  {%- if message.role != expected -%}
    {{- raise_exception('Gemma 3 needs turns that alternate user/assistant '
                        ~ '(after one optional first system message), but turn '
                        ~ loop.index ~ ' has role ' ~ message.role
                        ~ ' where ' ~ expected ~ ' was expected') -}}
  {%- endif -%}
  {{- '<start_of_turn>' ~ ('model' if message.role == 'assistant' else 'user') ~ '\\n' -}}
  {%- if loop.first -%}{{- ns.prefix -}}{%- endif -%}
  {{- message.content | trim -}}
  {{- '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""

# Used only when a model has no template and its architecture is unknown: ChatML is what
# llama.cpp falls back to as well, so a stock llama-server and Hearth build the same prompt.
CHATML_FALLBACK_TEMPLATE = """\
{%- for message in messages -%}
  {{- '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

# Formats of families whose GGUFs are known to ship without `tokenizer.chat_template`,
# keyed by `general.architecture`.
BUILTIN_TEMPLATES_BY_ARCHITECTURE = {"gemma3": GEMMA3_TEMPLATE}

_ROLES = frozenset({"system", "user", "assistant", "tool"})
# OpenAI renamed the system role for newer models; templates only know "system".
_ROLE_ALIASES = {"developer": "system"}

_KEY_CHAT_TEMPLATE = "tokenizer.chat_template"
_KEY_BOS_ID = "tokenizer.ggml.bos_token_id"
_KEY_EOS_ID = "tokenizer.ggml.eos_token_id"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with this template; the message says what to fix."""


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Serialises to JSON like transformers' chat-template `tojson` (no HTML escaping)."""
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change tool schemas
    # inside prompts; templates are written against transformers' behaviour instead.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    """Lets a template reject its input, as `raise_exception` does in transformers."""
    raise ChatTemplateError(f"the model's chat template rejected the messages: {message}")


class ChatTemplate:
    """A compiled chat template plus the special-token strings it is rendered with."""

    def __init__(
        self,
        source: str,
        bos_token: str,
        eos_token: str,
        *,
        origin: str = "custom",
        clock: Callable[[], datetime] = datetime.now,
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        # Where the template came from ("gguf", "builtin:<arch>", "fallback:chatml"), so the
        # dashboard and logs can show which format a model is being prompted with.
        self.origin = origin
        self._clock = clock
        # The same environment transformers uses, so templates written for it behave alike.
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = self._strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"chat template ({origin}) does not compile: line {exc.lineno}: {exc.message}"
            ) from exc

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        kwargs: dict | None = None,
    ) -> str:
        """Renders messages (and optional tool schemas) into the model's prompt text.

        kwargs are extra template variables (llama-server's chat_template_kwargs, e.g. enable_thinking)."""
        normalised = _normalise_messages(messages)
        now = self._clock()
        # llama-server's extra context: templates such as firefunction-v2 read the date as `datetime`
        # (and Llama 3.x as `date_string`) and the tools as a `functions` JSON text.
        context = {"datetime": now.strftime("%b %d %Y"), "date_string": now.strftime("%d %b %Y"),
                   "functions": json.dumps(tools, indent=2, ensure_ascii=False) if tools else "",
                   **(kwargs or {})}
        try:
            return self._template.render(
                **context,
                messages=normalised,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
            )
        except ChatTemplateError:
            raise
        except Exception as exc:
            # Templates are third-party code run on client input: any failure inside one is
            # a bad request for this model, never a crash of the engine thread.
            raise ChatTemplateError(
                f"chat template ({self.origin}) failed on these messages: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _strftime_now(self, format_string: str) -> str:
        """Formats the current local time; templates use it to date the system prompt."""
        return self._clock().strftime(format_string)


def fallback_template(bos_token: str = "", eos_token: str = "") -> ChatTemplate:
    """Returns the ChatML template used for models that bring no template of their own."""
    return ChatTemplate(CHATML_FALLBACK_TEMPLATE, bos_token, eos_token, origin="fallback:chatml")


def strip_leading_bos(text: str, bos_token: str) -> tuple[str, bool]:
    """Removes a leading BOS string; returns (rest, whether the template had emitted it)."""
    # llama.cpp adds BOS itself when tokenizing with add_special=True; a template that also
    # writes it would give the model two BOS tokens, which degrades its output.
    if bos_token and text.startswith(bos_token):
        return text[len(bos_token):], True
    return text, False


def template_for(source: str | None, architecture: str | None, bos_token: str, eos_token: str) -> ChatTemplate | None:
    """The model's own template if it has one, else its architecture's built-in one; None if neither."""
    if isinstance(source, str) and source.strip():
        return ChatTemplate(source, bos_token, eos_token, origin="gguf")
    builtin = BUILTIN_TEMPLATES_BY_ARCHITECTURE.get(architecture)
    if builtin is not None:
        return ChatTemplate(builtin, bos_token, eos_token, origin=f"builtin:{architecture}")
    return None


def template_from_gguf(path: str | PathLike[str]) -> ChatTemplate | None:
    """Reads a GGUF's chat template (or its architecture's built-in one); None if neither."""
    metadata = _read_gguf_chat_metadata(path)
    bos_token, eos_token = _special_tokens(metadata)
    return template_for(metadata.fields.get(_KEY_CHAT_TEMPLATE), metadata.architecture, bos_token, eos_token)


def load_chat_template(path: str | PathLike[str]) -> ChatTemplate:
    """Returns the template to prompt a GGUF with: its own, a built-in one, or ChatML."""
    template = template_from_gguf(path)
    if template is not None:
        return template
    return fallback_template(*_special_tokens(_read_gguf_chat_metadata(path)))


def _normalise_messages(messages: list[dict]) -> list[dict]:
    """Validates OpenAI-style messages and flattens content parts to plain strings."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    normalised = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{index}] must be an object with role and content")
        role = message.get("role")
        role = _ROLE_ALIASES.get(role, role)
        if role not in _ROLES:
            raise ChatTemplateError(
                f"messages[{index}].role is {role!r}; use one of {', '.join(sorted(_ROLES))}"
            )
        copy = dict(message)
        copy["role"] = role
        copy["content"] = _content_text(message.get("content"), index)
        normalised.append(copy)
    return normalised


def _content_text(content: Any, index: int) -> str:
    """Turns a message's content (string, None or list of text parts) into one string."""
    # Parts are flattened for every template, not only those that expect strings: this
    # engine is text-only, and templates that accept lists also accept strings.
    if content is None:
        # An assistant message that only carries tool_calls has no content.
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError(
            f"messages[{index}].content must be a string or a list of text parts"
        )
    texts = []
    for part_index, part in enumerate(content):
        where = f"messages[{index}].content[{part_index}]"
        if not isinstance(part, Mapping):
            raise ChatTemplateError(
                f'{where} must be an object like {{"type": "text", "text": "..."}}'
            )
        if part.get("type") != "text":
            raise ChatTemplateError(
                f"{where} has type {part.get('type')!r}; this server accepts text parts only"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"{where}.text must be a string")
        texts.append(text)
    # Newline-joined, as llama-server joins text parts for templates that expect strings.
    return "\n".join(texts)


def _special_tokens(metadata: "GgufMetadata") -> tuple[str, str]:
    """Returns the (BOS, EOS) token strings, "" for any the GGUF does not define."""
    fields = metadata.fields
    return (
        metadata.token_text(fields.get(_KEY_BOS_ID)) or "",
        metadata.token_text(fields.get(_KEY_EOS_ID)) or "",
    )


def _read_gguf_chat_metadata(path: str | PathLike[str]) -> "GgufMetadata":
    """Reads a GGUF's header, reporting an unreadable file as a ChatTemplateError."""
    # Imported here: the runner builds its template from llama.cpp's view of the model and never
    # needs the gguf package (about 5 MiB of its resident memory).
    from app.gguf_meta import GgufError, read_metadata

    try:
        return read_metadata(path)
    except GgufError as exc:
        raise ChatTemplateError(f"{path} is not a readable GGUF file: {exc}") from exc
