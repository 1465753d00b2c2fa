"""Tests for app.engine.text: UTF-8-safe streaming and stop strings across pieces."""

import pytest

from app.engine.text import StopMatcher, Utf8Stream

SAMPLES = [
    "plain ascii",
    "héllo wörld",  # 2-byte characters
    "€ and 日本語",  # 3-byte characters
    "family 👨‍👩‍👧 and 🔥",  # 4-byte characters joined by ZWJ
]


def decode_pieces(pieces: list[bytes]) -> list[str]:
    """Feeds pieces to a fresh stream and returns every emitted chunk, flush included."""
    stream = Utf8Stream()
    chunks = [stream.push(piece) for piece in pieces]
    chunks.append(stream.flush())
    return chunks


def assert_whole_characters(chunks: list[str]) -> None:
    """Every emitted chunk must be valid text on its own, with no replacement characters."""
    for chunk in chunks:
        assert "\ufffd" not in chunk
        chunk.encode("utf-8")


@pytest.mark.parametrize("text", SAMPLES)
def test_every_two_piece_split_yields_the_text(text):
    data = text.encode("utf-8")
    for cut in range(len(data) + 1):
        chunks = decode_pieces([data[:cut], data[cut:]])
        assert_whole_characters(chunks)
        assert "".join(chunks) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_at_a_time_yields_the_text(text):
    chunks = decode_pieces([bytes([byte]) for byte in text.encode("utf-8")])
    assert_whole_characters(chunks)
    assert "".join(chunks) == text


def test_incomplete_character_is_held_until_complete():
    stream = Utf8Stream()
    fire = "🔥".encode()
    assert stream.push(b"a" + fire[:1]) == "a"
    assert stream.push(fire[1:3]) == ""
    assert stream.push(fire[3:]) == "🔥"
    assert stream.flush() == ""


def test_invalid_bytes_become_replacement_characters():
    chunks = decode_pieces([b"ok\xff", b"\xfe!"])
    assert "".join(chunks) == "ok\ufffd\ufffd!"


def test_truncated_character_at_end_becomes_replacement_on_flush():
    stream = Utf8Stream()
    assert stream.push(b"x" + "€".encode()[:2]) == "x"
    assert stream.flush() == "\ufffd"


def test_flush_resets_the_stream_for_reuse():
    stream = Utf8Stream()
    stream.push(b"\xe2")
    stream.flush()
    assert stream.push("é".encode()) == "é"


def run_matcher(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """Streams pieces through a matcher; returns (all emitted text, whether it stopped)."""
    matcher = StopMatcher(stops)
    emitted = []
    stopped = False
    for piece in pieces:
        text, stopped = matcher.push(piece)
        emitted.append(text)
        if stopped:
            break
    if not stopped:
        emitted.append(matcher.flush())
    return "".join(emitted), stopped


def splits_of(text: str):
    """Yields every way to cut text into two and into three pieces."""
    for first in range(len(text) + 1):
        yield [text[:first], text[first:]]
        for second in range(first, len(text) + 1):
            yield [text[:first], text[first:second], text[second:]]


def test_stop_split_across_pieces_at_every_offset():
    text = "The answer is 42.<end_of_turn>ignored tail"
    for pieces in splits_of(text):
        assert run_matcher(["<end_of_turn>"], pieces) == ("The answer is 42.", True), pieces


def test_no_stop_emits_everything_at_every_offset():
    text = "an <end_of and <end but never the full marker <"
    for pieces in splits_of(text):
        assert run_matcher(["<end_of_turn>"], pieces) == (text, False), pieces


def test_partial_stop_is_held_back_then_released():
    matcher = StopMatcher(["STOP"])
    assert matcher.push("abc ST") == ("abc ", False)
    assert matcher.push("O") == ("", False)
    assert matcher.push("P!") == ("", True)
    assert matcher.matched_stop == "STOP"
    matcher = StopMatcher(["STOP"])
    assert matcher.push("abc ST") == ("abc ", False)
    assert matcher.push("OMP") == ("STOMP", False)


def test_flush_releases_held_text_when_generation_ends():
    matcher = StopMatcher(["\n\n"])
    assert matcher.push("last line\n") == ("last line", False)
    assert matcher.flush() == "\n"
    assert matcher.flush() == ""


def test_stop_at_start_emits_nothing():
    assert run_matcher(["###"], ["###", " more"]) == ("", True)
    assert run_matcher(["###"], ["#", "#", "#"]) == ("", True)


def test_nothing_is_emitted_after_a_stop():
    matcher = StopMatcher(["x"])
    assert matcher.push("axb") == ("a", True)
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_earliest_of_multiple_stops_wins():
    assert run_matcher(["world", "lo"], ["hello world"]) == ("hel", True)
    assert run_matcher(["lo", "world"], ["hel", "l", "o world"]) == ("hel", True)


def test_overlapping_stops_hold_back_the_longest_possible_start():
    # "abcd" is held as a possible start of "abcde" even after "abc" cannot complete.
    text = "xx abcd abcdf abcde tail"
    for pieces in splits_of(text):
        assert run_matcher(["abcde", "bcdf"], pieces) == ("xx abcd a", True), pieces


def test_self_overlapping_stop_is_found():
    for pieces in splits_of("aaab"):
        assert run_matcher(["aab"], pieces) == ("a", True), pieces


def test_empty_and_absent_stops_pass_text_through():
    assert StopMatcher([]).push("anything") == ("anything", False)
    assert StopMatcher([""]).push("anything") == ("anything", False)
    assert run_matcher(["", "!"], ["hi", "!", "?"]) == ("hi", True)


def test_utf8_stream_and_stop_matcher_compose():
    data = "¿Qué? 🔥<end_of_turn>".encode()
    for cut in range(len(data) + 1):
        stream, matcher = Utf8Stream(), StopMatcher(["<end_of_turn>"])
        emitted = []
        for piece in (data[:cut], data[cut:]):
            text, stopped = matcher.push(stream.push(piece))
            emitted.append(text)
        assert stopped
        assert "".join(emitted) == "¿Qué? 🔥"
