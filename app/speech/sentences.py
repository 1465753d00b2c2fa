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
# Longer than any abbreviation above: a cut word in the look back is longer than all of them, so never one.
_LOOK_BACK = 16
# The most text held waiting for a sentence's end: a run-on answer is spoken in pieces of at most this.
MAX_PENDING_CHARS = 1000


class SentenceBuffer:
    """Text in (`add`), complete sentences out; `finish` gives what is left."""

    def __init__(self, max_pending: int = MAX_PENDING_CHARS):
        self.pending = ""
        self.max_pending = max_pending
        self.settled = 0  # where in pending the last end passed over (an abbreviation's) starts: earlier ones stay so

    def add(self, text: str) -> list[str]:
        """The sentences the new text completes.

        Linear in the text: an end passed over once (after an abbreviation) is passed over again whatever follows, so
        the scan resumes at the last one instead of reading every "e.g." of the pending text at every chunk."""
        self.pending += text
        out, start, passed = [], 0, None
        for m in _END.finditer(self.pending, self.settled):
            # Only the word before the end decides (abbreviations are short): a bounded look back.
            before = self.pending[max(start, m.start() - _LOOK_BACK):m.start()]
            if _abbreviated(before) and not m.group().startswith("\n"):
                passed = m.start()
                continue
            if candidate := self.pending[start:m.end()].strip():
                out.append(candidate)
            start = m.end()
        self.pending = self.pending[start:]
        self.settled = passed - start if passed is not None and passed >= start else 0
        if len(self.pending) > self.max_pending:
            cut = self.pending.rfind(" ", 0, self.max_pending)
            cut = cut if cut > 0 else self.max_pending
            out.append(self.pending[:cut].strip())
            self.pending = self.pending[cut:]
            self.settled = max(0, self.settled - cut)
        return out

    def finish(self) -> str:
        """What is left once the text has all arrived."""
        rest, self.pending, self.settled = self.pending.strip(), "", 0
        return rest


def _abbreviated(text: str) -> bool:
    word = text.rsplit(None, 1)[-1].lower() if text.strip() else ""
    return word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())
