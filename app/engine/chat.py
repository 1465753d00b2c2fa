"""Chat templates: turn OpenAI-style messages into the prompt text a model was trained on.

A GGUF usually carries its Jinja2 chat template in `tokenizer.chat_template`; it is rendered
the way Hugging Face transformers renders it (same sandbox, same helpers), so prompts match
what the model saw in training. Some GGUFs ship without one (the embedded Gemma 3 270M does):
for a known architecture Hearth supplies that family's format, otherwise a ChatML fallback.
"""

import json
from collections.abc import Callable
from datetime import datetime
from functools import cached_property
from os import PathLike
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.filters
from jinja2.exceptions import SecurityError
from jinja2.sandbox import SandboxedEnvironment

from app.engine.template_caps import TemplateCaps, mark_all_used, probe_caps, string_test, template_thinks
from app.engine.template_inputs import TemplateInputError, template_context, template_messages, template_tools

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
    mark_all_used(value)
    value = _plain(value)
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body, as llama.cpp."""

    tags = {"generation"}

    def parse(self, parser):
        """The block's body, unchanged."""
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _LenientUndefined(jinja2.ChainableUndefined):
    """llama.cpp's undefined: its attributes are undefined too, and it adds to text as the empty string."""

    def __getattr__(self, name: str):
        if self._undefined_exception is SecurityError and not name.startswith("_undefined"):
            # What the sandbox refused stays refused: never a chain that hides it.
            self._fail_with_undefined_error()
        return super().__getattr__(name)

    def __str__(self) -> str:
        if self._undefined_exception is SecurityError:
            self._fail_with_undefined_error()
        return super().__str__()

    def __add__(self, other):
        return other if isinstance(other, str) else super().__add__(other)

    def __radd__(self, other):
        return other if isinstance(other, str) else super().__radd__(other)


def _plain(value: Any) -> Any:
    """Lazy sequences (a `map` or `select` filter's generator) as lists, so they serialise as llama.cpp's arrays do."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or (hasattr(value, "__next__") and hasattr(value, "__iter__")):
        return [_plain(v) for v in value]
    return value


def _string(value: Any) -> str:
    """`string` as llama.cpp has it: the value's text (a dict or list in Python's repr), which reads it whole."""
    mark_all_used(value)
    return jinja2.filters.soft_str(value)


def _safe(value: Any) -> Any:
    """`safe` as llama.cpp has it: the value unchanged (nothing is escaped here, so there is nothing to mark)."""
    return value


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
        # transformers' settings in a sandbox that lets a template build its own lists (Kimi's `ns.x.append`),
        # as llama.cpp's engine does: every render gets fresh copies of its inputs, so nothing shared changes.
        # Undefined values are lenient as llama.cpp's are: an attribute of one is undefined, text + one is text.
        environment = SandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag],
            undefined=_LenientUndefined,
        )
        environment.filters["tojson"] = _tojson
        environment.tests["string"] = string_test
        # Jinja's Markup would HTML-escape what is concatenated to a `safe` string; llama.cpp escapes nothing.
        environment.filters["safe"] = _safe
        environment.filters["string"] = _string
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = self._strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"chat template ({origin}) does not compile: line {exc.lineno}: {exc.message}"
            ) from exc

    @cached_property
    def caps(self) -> TemplateCaps:
        """What the template supports, probed as llama.cpp probes it (system role, tool calls, object arguments...)."""
        return probe_caps(self._probe)

    @cached_property
    def supports_thinking(self) -> bool:
        """Whether llama.cpp finds reasoning in this template (llama-server then turns enable_thinking on)."""
        return template_thinks(self.source, self._probe)

    def _probe(self, messages: list, tools: list, variables: dict) -> tuple[bool, str]:
        """One render of a capability probe: (succeeded, output); a template's failure is an answer here."""
        context = {"messages": messages, "tools": tools, "bos_token": "", "eos_token": "",
                   "add_generation_prompt": True, **variables}
        try:
            return True, self._template.render(**context)
        except Exception:
            return False, ""

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        kwargs: dict | None = None,
    ) -> str:
        """Renders messages (and optional tool schemas) into the model's prompt text, as llama.cpp renders them.

        kwargs are extra template variables (llama-server's chat_template_kwargs, e.g. enable_thinking)."""
        try:
            prepared = template_messages(messages, self.caps, self.source)
        except TemplateInputError as exc:
            raise ChatTemplateError(str(exc)) from exc
        context = template_context(self._clock(), prepared, template_tools(tools), add_generation_prompt,
                                   self.bos_token, self.eos_token, kwargs or {})
        try:
            return self._template.render(**context)
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
