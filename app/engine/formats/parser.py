"""AnswerParser: one answer's generated text, pushed as it comes, split into pieces and a whole Answer."""

from __future__ import annotations

import functools
from collections.abc import Callable

from app.engine.formats import gemma, json_calls, xml_calls
from app.engine.formats.base import (
    Answer,
    CallArguments,
    CallStart,
    ChatFormat,
    Content,
    Piece,
    Reasoning,
    ToolCall,
    Tools,
)
from app.engine.formats.calls import CallScanner, CallSyntax
from app.engine.formats.harmony import HarmonyScanner
from app.engine.formats.reasoning import THOUGHT, VERBATIM, ThinkSplitter

# Each family's call syntax, by format name; a family not listed here parses no calls.
SYNTAXES: dict[str, Callable[[], CallSyntax]] = {
    "generic": json_calls.generic_syntax,
    "hermes": json_calls.hermes_syntax,
    "qwen3_coder": xml_calls.qwen3_coder_syntax,
    "llama3": json_calls.llama3_syntax,
    "mistral": json_calls.mistral_syntax,
    "magistral": json_calls.mistral_syntax,
    "granite": json_calls.granite_syntax,
    "command_r": json_calls.command_r_syntax,
    "deepseek_r1": json_calls.deepseek_syntax,
    "deepseek_v3": json_calls.deepseek_syntax,
    "functionary_v3_1": json_calls.functionary_v3_1_syntax,
    "functionary_v3_2": xml_calls.functionary_v3_2_syntax,
    "kimi_k2": json_calls.kimi_syntax,
    "gemma4": gemma.gemma4_syntax,
}


@functools.cache
def syntax_of(name: str) -> CallSyntax:
    """The family's call syntax (made once: it holds no state)."""
    return SYNTAXES.get(name, CallSyntax)()


class AnswerParser:
    """Splits one answer into reasoning, content and calls, chunk by chunk.

    push() scans only the new text and holds back only what could still begin a marker;
    finish() decides the rest. The pieces' texts concatenate exactly to `answer`'s fields.
    """

    def __init__(self, fmt: ChatFormat, tools: list[dict] | None, *, split_reasoning: bool = True,
                 in_thought: bool = False, early_names: bool = False):
        self.fmt = fmt
        syntax = syntax_of(fmt.name)
        self._tools = Tools(tools)
        # early_names: a call's name goes out (CallStart) as soon as it is written, its arguments when the call is
        # whole. Asked for only under a call grammar: a call then ends whole or is cut, and a cut call whose name
        # went out is dropped (never content), so `answer` holds the whole calls only.
        self._scanner = CallScanner(syntax, self._tools, early=early_names)
        self._open_calls: dict[str, int] = {}  # id -> index of a call whose name went out, its arguments not yet
        self._num_started = 0
        self._splitter = None
        self._opened = ""
        self._harmony = None
        if fmt.name == "gpt_oss":
            self._harmony = HarmonyScanner(self._tools, split=split_reasoning, in_thought=in_thought)
            if in_thought and not split_reasoning:
                self._opened = fmt.think_start
        elif fmt.reasoning and fmt.think_end:
            closers = syntax.markers if self._tools else ()
            self._splitter = ThinkSplitter(fmt.think_start, fmt.think_end, split=split_reasoning,
                                           in_thought=in_thought, closers=closers)
            if in_thought and not split_reasoning:
                # The thought the prompt opened is content too, as llama-server writes it.
                self._opened = fmt.think_start + "\n"
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._answer: Answer | None = None

    @property
    def answer(self) -> Answer:
        """The whole answer (after finish)."""
        if self._answer is None:
            raise RuntimeError("AnswerParser.answer is known only after finish()")
        return self._answer

    def push(self, text: str) -> list[Piece]:
        """The pieces decided by this chunk of generated text."""
        out: list[Piece] = []
        if self._opened:
            self._add_content(out, self._opened)
            self._opened = ""
        if self._harmony is not None:
            self._visible(self._harmony.push(text), out)
            return out
        if self._splitter is None:
            self._visible(self._scanner.push(text), out)
            return out
        for kind, part in self._splitter.push(text):
            self._part(kind, part, out)
        return out

    def finish(self, cut: bool = False) -> list[Piece]:
        """The pieces still held, decided at the end of the answer (`cut`: by max_tokens); `answer` is known from
        now on. A cut inside a named call loses that call only, never the calls before it."""
        out = self.push("") if self._opened else []
        if self._harmony is not None:
            self._visible(self._harmony.finish(), out)
        if self._splitter is not None:
            for kind, part in self._splitter.finish():
                self._part(kind, part, out)
        if self._harmony is None:
            self._visible(self._scanner.finish(cut), out)
        self._answer = Answer("".join(self._reasoning), "".join(self._content), tuple(self._calls))
        return out

    def _part(self, kind: int, text: str, out: list[Piece]) -> None:
        if kind == THOUGHT:
            self._reasoning.append(text)
            if out and type(out[-1]) is Reasoning:
                out[-1] = Reasoning(out[-1].text + text)
            else:
                out.append(Reasoning(text))
        elif kind == VERBATIM:
            self._add_content(out, text)
        else:
            self._visible(self._scanner.push(text), out)

    def _add_content(self, out: list[Piece], text: str) -> None:
        self._content.append(text)
        if out and type(out[-1]) is Content:
            out[-1] = Content(out[-1].text + text)
        else:
            out.append(Content(text))

    def _visible(self, events: list, out: list[Piece]) -> None:
        for kind, *rest in events:
            value = rest[0] if len(rest) == 1 else rest
            if kind == "c":
                self._add_content(out, value)
            elif kind == "r":
                self._part(THOUGHT, value, out)
            elif kind == "start":
                call_id, name = value
                self._open_calls[call_id] = self._num_started
                out.append(CallStart(self._num_started, call_id, name))
                self._num_started += 1
            else:
                index = self._open_calls.pop(value.id, None)
                if index is None:
                    index = self._num_started
                    self._num_started += 1
                    out.append(CallStart(index, value.id, value.name))
                self._calls.append(ToolCall(value.name, value.arguments, value.id))
                out.append(CallArguments(index, value.arguments))


def parse_answer(fmt: ChatFormat, tools: list[dict] | None, text: str, cut: bool = False, **options) -> Answer:
    """A whole answer at once (the same parser, one push); `cut`: max_tokens ended it."""
    parser = AnswerParser(fmt, tools, **options)
    parser.push(text)
    parser.finish(cut)
    return parser.answer
