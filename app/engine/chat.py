"""Chat templates: turn OpenAI-style messages into the prompt text a model was trained on.

A GGUF usually carries its Jinja2 chat template in `tokenizer.chat_template`; it is rendered
the way Hugging Face transformers renders it (same sandbox, same helpers), so prompts match
what the model saw in training. Some GGUFs ship without one (the embedded Gemma 3 270M does):
for a known architecture Hearth supplies that family's format, otherwise a ChatML fallback.
"""

import json
import mmap
import struct
from collections.abc import Callable, Mapping
from datetime import datetime
from os import PathLike
from typing import Any

import jinja2
import jinja2.ext
from gguf.constants import GGUF_MAGIC, GGUFValueType
from jinja2.sandbox import ImmutableSandboxedEnvironment

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
_KEY_ARCHITECTURE = "general.architecture"
_KEY_TOKENS = "tokenizer.ggml.tokens"
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
    ) -> str:
        """Renders messages (and optional tool schemas) into the model's prompt text."""
        normalised = _normalise_messages(messages)
        try:
            return self._template.render(
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


def template_from_gguf(path: str | PathLike[str]) -> ChatTemplate | None:
    """Reads a GGUF's chat template (or its architecture's built-in one); None if neither."""
    metadata = _read_gguf_chat_metadata(path)
    bos_token, eos_token = _special_tokens(metadata)
    source = metadata.get(_KEY_CHAT_TEMPLATE)
    if isinstance(source, str) and source.strip():
        return ChatTemplate(source, bos_token, eos_token, origin="gguf")
    architecture = metadata.get(_KEY_ARCHITECTURE)
    builtin = BUILTIN_TEMPLATES_BY_ARCHITECTURE.get(architecture)
    if builtin is not None:
        return ChatTemplate(builtin, bos_token, eos_token, origin=f"builtin:{architecture}")
    return None


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


def _special_tokens(metadata: dict[str, Any]) -> tuple[str, str]:
    """Returns the (BOS, EOS) token strings, "" for any the GGUF does not define."""
    tokens: list[str] = metadata.get(_KEY_TOKENS, [])

    def text_of(token_id: Any) -> str:
        if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
            return ""
        return tokens[token_id]

    return text_of(metadata.get(_KEY_BOS_ID)), text_of(metadata.get(_KEY_EOS_ID))


def _read_gguf_chat_metadata(path: str | PathLike[str]) -> dict[str, Any]:
    """Reads only the metadata chat templating needs from a GGUF header."""
    # gguf.GGUFReader wraps every vocabulary entry and every tensor in numpy views: about
    # 8 s for Gemma 3's 262k-token vocabulary. Walking the header with struct reads only
    # the few keys needed here, skips the rest, and never touches the weights.
    with open(path, "rb") as file, _map_readonly(file, path) as view:
        return _GgufHeaderWalker(view, str(path)).chat_metadata()


def _map_readonly(file: Any, path: str | PathLike[str]) -> mmap.mmap:
    """Memory-maps a file read-only; pages of the header are the only ones touched."""
    try:
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError as exc:
        raise ChatTemplateError(f"{path} is empty, not a GGUF file") from exc


_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


class _GgufHeaderWalker:
    """Sequential reader over a GGUF header's key/value section."""

    def __init__(self, view: mmap.mmap, name: str) -> None:
        self._view = view
        self._name = name
        self._offset = 0
        self._byte_order = "<"

    def chat_metadata(self) -> dict[str, Any]:
        """Returns architecture, chat template, BOS/EOS ids and the needed vocabulary."""
        try:
            return self._chat_metadata()
        except (struct.error, ValueError, IndexError) as exc:
            raise ChatTemplateError(f"{self._name} is not a readable GGUF file: {exc}") from exc

    def _chat_metadata(self) -> dict[str, Any]:
        """Walks every key, keeping scalars of interest and the vocabulary's position."""
        (magic,) = struct.unpack_from("<I", self._view, 0)
        if magic != GGUF_MAGIC:
            raise ValueError("bad magic number")
        (version,) = struct.unpack_from("<I", self._view, 4)
        # A big-endian GGUF reads as a huge version number on a little-endian host.
        if version & 0xFFFF == 0:
            self._byte_order = ">"
        self._offset = 8
        self._read("Q")  # tensor count: tensors are never read here
        key_count = self._read("Q")
        wanted_scalars = {_KEY_CHAT_TEMPLATE, _KEY_ARCHITECTURE, _KEY_BOS_ID, _KEY_EOS_ID}
        metadata: dict[str, Any] = {}
        tokens_at: tuple[int, int] | None = None
        for _ in range(key_count):
            key = self._read_string()
            value_type = GGUFValueType(self._read("I"))
            if key == _KEY_TOKENS and value_type == GGUFValueType.ARRAY:
                item_type = GGUFValueType(self._read("I"))
                count = self._read("Q")
                if item_type != GGUFValueType.STRING:
                    raise ValueError(f"{_KEY_TOKENS} is not an array of strings")
                tokens_at = (self._offset, count)
                self._skip_strings(count)
            elif key in wanted_scalars and value_type != GGUFValueType.ARRAY:
                metadata[key] = self._read_value(value_type)
            else:
                self._skip_value(value_type)
        if tokens_at is not None:
            metadata[_KEY_TOKENS] = self._tokens_up_to(tokens_at, metadata)
        return metadata

    def _tokens_up_to(self, tokens_at: tuple[int, int], metadata: dict[str, Any]) -> list[str]:
        """Decodes vocabulary entries up to the highest BOS/EOS id (usually a handful)."""
        ids = [metadata.get(key) for key in (_KEY_BOS_ID, _KEY_EOS_ID)]
        start, count = tokens_at
        needed = min(count, max((i + 1 for i in ids if isinstance(i, int) and i >= 0), default=0))
        self._offset = start
        return [self._read_string() for _ in range(needed)]

    def _read(self, code: str) -> Any:
        """Reads one scalar in the file's byte order."""
        (value,) = struct.unpack_from(self._byte_order + code, self._view, self._offset)
        self._offset += struct.calcsize(code)
        return value

    def _read_string(self) -> str:
        """Reads a length-prefixed string; invalid UTF-8 is replaced, never fatal."""
        length = self._read("Q")
        end = self._offset + length
        if end > len(self._view):
            raise ValueError("string runs past the end of the file")
        text = self._view[self._offset:end].decode("utf-8", errors="replace")
        self._offset = end
        return text

    def _read_value(self, value_type: GGUFValueType) -> Any:
        """Reads a scalar or string value."""
        if value_type == GGUFValueType.STRING:
            return self._read_string()
        return self._read(_SCALAR_FORMATS[value_type])

    def _skip_strings(self, count: int) -> None:
        """Skips `count` length-prefixed strings without decoding them."""
        unpack = struct.Struct(self._byte_order + "Q").unpack_from
        offset = self._offset
        for _ in range(count):
            offset += 8 + unpack(self._view, offset)[0]
        self._offset = offset

    def _skip_value(self, value_type: GGUFValueType) -> None:
        """Skips one value of any type, arrays included."""
        if value_type == GGUFValueType.STRING:
            self._skip_strings(1)
        elif value_type == GGUFValueType.ARRAY:
            item_type = GGUFValueType(self._read("I"))
            count = self._read("Q")
            if item_type == GGUFValueType.STRING:
                self._skip_strings(count)
            elif item_type == GGUFValueType.ARRAY:
                for _ in range(count):
                    self._skip_value(item_type)
            else:
                self._offset += count * struct.calcsize(_SCALAR_FORMATS[item_type])
        else:
            self._offset += struct.calcsize(_SCALAR_FORMATS[value_type])
