"""Streaming text helpers: UTF-8-safe token pieces and stop strings that span pieces.

Token pieces are bytes, and one character may be split across two tokens (byte-fallback
tokens, emoji); a stop string may likewise be split across pieces. Both helpers hold back
just enough to never emit a broken character or the start of a stop string.
"""

import codecs


class Utf8Stream:
    """Turns a stream of byte pieces into text, never splitting a UTF-8 character."""

    def __init__(self) -> None:
        # errors="replace": a model can emit invalid bytes; that must become U+FFFD in the
        # output, never an exception inside the engine loop.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, piece: bytes) -> str:
        """Adds one token's bytes and returns the text that is now complete."""
        return self._decoder.decode(piece, final=False)

    def flush(self) -> str:
        """Ends the stream; an incomplete trailing character becomes U+FFFD."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


class StopMatcher:
    """Finds stop strings in streamed text, holding back what could be a stop's beginning."""

    def __init__(self, stops: list[str]) -> None:
        # An empty stop string would match everywhere and end every generation at once.
        self._stops = sorted({stop for stop in stops if stop}, key=len, reverse=True)
        self._held = ""
        self.stopped = False
        self.matched_stop: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """Adds text; returns (text safe to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._held + text
        hit = self._earliest_stop(buffer)
        if hit is not None:
            start, stop = hit
            self._held = ""
            self.stopped = True
            self.matched_stop = stop
            return buffer[:start], True
        hold_chars = self._longest_partial_stop(buffer)
        emit_chars = len(buffer) - hold_chars
        self._held = buffer[emit_chars:]
        return buffer[:emit_chars], False

    def flush(self) -> str:
        """Releases held-back text when generation ends without a stop string."""
        if self.stopped:
            return ""
        text, self._held = self._held, ""
        return text

    def _earliest_stop(self, buffer: str) -> tuple[int, str] | None:
        # The earliest start wins: text after it must never be emitted, even if a different
        # stop string happens to end sooner.
        best: tuple[int, str] | None = None
        for stop in self._stops:
            start = buffer.find(stop)
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def _longest_partial_stop(self, buffer: str) -> int:
        # Invariant: every occurrence of a stop string that has not completed yet starts
        # inside the held suffix, because emitted text never ends with a stop's proper prefix.
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
