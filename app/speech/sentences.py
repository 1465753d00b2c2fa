"""Sentences out of text that arrives in pieces (Home Assistant streams an agent's answer a few characters at a
time): each sentence is handed out as soon as it is known to be complete, so it can be spoken while the rest of the
answer is still being written.

A sentence ends at `.`, `!`, `?` or `…` (with any closing quotes or brackets after it) once whitespace follows it,
or at a line break; a period after a common abbreviation ("Dr.", "e.g.") or a single capital ("J.") does not end
one. A number's decimal point never does: no whitespace follows it.
"""

from __future__ import annotations

import re

# Ends: the terminal punctuation, closing marks, then the whitespace that proves the sentence is over.
_END = re.compile(r"[.!?…]+[\"'”’)\]]*\s+|\n\s*")
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "st", "vs", "etc", "e.g", "i.e", "no", "jr", "sr", "prof", "approx"})
# The most text held waiting for a sentence's end: a run-on answer is spoken in pieces of at most this.
MAX_PENDING_CHARS = 1000


class SentenceBuffer:
    """Text in (`add`), complete sentences out; `finish` gives what is left."""

    def __init__(self, max_pending: int = MAX_PENDING_CHARS):
        self.pending = ""
        self.max_pending = max_pending

    def add(self, text: str) -> list[str]:
        """The sentences the new text completes."""
        self.pending += text
        out, start = [], 0
        for m in _END.finditer(self.pending):
            candidate = self.pending[start:m.start()].strip()
            if _abbreviated(candidate) and not m.group().startswith("\n"):
                continue
            if candidate := self.pending[start:m.end()].strip():
                out.append(candidate)
            start = m.end()
        self.pending = self.pending[start:]
        if len(self.pending) > self.max_pending:
            cut = self.pending.rfind(" ", 0, self.max_pending)
            cut = cut if cut > 0 else self.max_pending
            out.append(self.pending[:cut].strip())
            self.pending = self.pending[cut:]
        return out

    def finish(self) -> str:
        """What is left once the text has all arrived."""
        rest, self.pending = self.pending.strip(), ""
        return rest


def _abbreviated(text: str) -> bool:
    word = text.rsplit(None, 1)[-1].lower() if text.strip() else ""
    return word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())
