"""A request's reasoning budget, as llama-server's `--reasoning-budget` (common/reasoning-budget.cpp).

The engine counts the tokens a sequence generates inside a thought (between the model's start and end
markers, e.g. "<think>" and "</think>"); once the budget is spent before the end marker, the end
sequence (an optional message, then the end marker) is forced: its tokens are taken instead of
sampled, one per step, and go through the sampler's bookkeeping and the text stream like any token.
Budget 0 ends a thought as soon as it opens (at once when the prompt opened it); -1 only counts.
A new thought after the end gets a fresh budget (some models think several times in one answer).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

UNLIMITED = -1


@dataclass(frozen=True)
class ReasoningBudget:
    """How a request's thoughts are bounded: the markers as tokens, the budget, where the prompt left off."""

    start: tuple[int, ...]  # the thought's opening marker, as tokens
    end: tuple[int, ...]  # its closing marker, as tokens: forced when the budget is spent
    budget: int = UNLIMITED  # tokens a thought may take (-1: unlimited, only counted; 0: none)
    in_thought: bool = False  # the prompt ends inside an open thought (a Qwen3 or DeepSeek-R1 prompt)
    message: tuple[int, ...] = ()  # tokens forced before the end marker when the budget is spent

    def __post_init__(self):
        if not self.start or not self.end:
            raise ValueError("a reasoning budget needs the thought's start and end markers as tokens")
        if self.budget < UNLIMITED:
            raise ValueError(f"a reasoning budget is -1 (unlimited) or a number of tokens, not {self.budget}")


class Phase(enum.Enum):
    """Where a sequence stands with respect to its thoughts."""

    OUTSIDE = "outside"  # no thought open
    THINKING = "thinking"  # inside a thought, counting its tokens
    WAITING_UTF8 = "waiting_utf8"  # the budget is spent but the last token left a character unfinished
    FORCING = "forcing"  # the end sequence is being forced


def ends_whole_character(piece: bytes) -> bool:
    """True when a token's bytes end at a UTF-8 character boundary (llama.cpp's common_utf8_is_complete)."""
    for back in range(1, min(4, len(piece)) + 1):
        byte = piece[-back]
        if byte & 0xC0 == 0x80:
            continue  # a continuation byte: its lead is further back
        if byte < 0x80:
            return back == 1
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4
        return back >= need
    return True  # only continuation bytes: the tail of a character begun in an earlier token


class BudgetTracker:
    """One sequence's budget state, fed every generated token; says which token to force next."""

    def __init__(self, spec: ReasoningBudget):
        self.spec = spec
        self.forced = spec.message + spec.end
        self.phase = Phase.OUTSIDE
        self.remaining = 0
        self.force_pos = 0
        self.num_thought_tokens = 0  # generated inside a thought, its markers included
        self._tail: list[int] = []  # the last tokens, for matching multi-token markers
        self._keep = max(len(spec.start), len(spec.end))
        if spec.in_thought:
            self._open()

    def next_forced(self) -> int | None:
        """The token to take instead of sampling this step (None: sample as usual)."""
        if self.phase is Phase.FORCING:
            return self.forced[self.force_pos]
        return None

    def give_up(self) -> None:
        """The forced token was refused (the request's grammar does not admit it): stop forcing, keep counting."""
        self.phase = Phase.THINKING
        self.remaining = -1  # never forces again in this thought
        self._tail.clear()

    def accept(self, token: int, piece: bytes) -> None:
        """Account for one generated (or forced) token and its bytes."""
        phase = self.phase
        if phase is Phase.OUTSIDE:
            if self._matches(token, self.spec.start):
                self.num_thought_tokens += 1
                self._open()
            return
        self.num_thought_tokens += 1
        if phase is Phase.FORCING:
            self.force_pos += 1
            if self.force_pos >= len(self.forced):
                self._close()
            return
        if self._matches(token, self.spec.end):
            self._close()
            return
        if phase is Phase.WAITING_UTF8:
            if ends_whole_character(piece):
                self._force()
            return
        if self.remaining > 0:
            self.remaining -= 1
            if self.remaining == 0:
                if ends_whole_character(piece):
                    self._force()
                else:
                    self.phase = Phase.WAITING_UTF8

    def _matches(self, token: int, marker: tuple[int, ...]) -> bool:
        tail = self._tail
        tail.append(token)
        if len(tail) > self._keep:
            del tail[0]
        n = len(marker)
        if n == 1:
            return token == marker[0]
        return len(tail) >= n and tuple(tail[-n:]) == marker

    def _open(self) -> None:
        self._tail.clear()
        budget = self.spec.budget
        if budget == 0:
            self._force()
            return
        self.phase = Phase.THINKING
        self.remaining = budget  # -1 never reaches 0 by counting down: unlimited

    def _force(self) -> None:
        self.phase = Phase.FORCING
        self.force_pos = 0
        self._tail.clear()

    def _close(self) -> None:
        self.phase = Phase.OUTSIDE
        self._tail.clear()
