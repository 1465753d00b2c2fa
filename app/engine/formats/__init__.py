"""The model families' answer formats (contract C1): detect a template's format, split answers.

`detect(template_source)` names the family; `AnswerParser` turns generated text, streamed or
whole, into reasoning, content and tool calls; `call_grammar` constrains a family's calls.
"""

from app.engine.formats.base import (
    Answer,
    CallArguments,
    CallStart,
    ChatFormat,
    Content,
    Piece,
    Reasoning,
    ToolCall,
    new_call_id,
)
from app.engine.formats.detection import FORMATS, GENERIC, detect, starts_in_thought
from app.engine.formats.grammars import call_grammar, call_marker
from app.engine.formats.parser import AnswerParser, parse_answer

__all__ = ["FORMATS", "GENERIC", "Answer", "AnswerParser", "CallArguments", "CallStart", "ChatFormat", "Content",
           "Piece", "Reasoning", "ToolCall", "call_grammar", "call_marker", "detect", "new_call_id", "parse_answer", "starts_in_thought"]
