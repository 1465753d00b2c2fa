"""Sentences out of text arriving in pieces: the same sentences whatever the pieces, each handed out once whitespace
after its end has arrived; abbreviations, initials and decimals do not end one; a run-on text is cut."""

from __future__ import annotations

import pytest

from app.speech.sentences import SentenceBuffer

TEXT = 'Hello there. Dr. Smith says it is 3.5 degrees! Is it? "Yes." J. R. waits… Then go.\nNew line ok'
SENTENCES = ["Hello there.", "Dr. Smith says it is 3.5 degrees!", "Is it?", '"Yes."', "J. R. waits…", "Then go.",
             "New line ok"]


@pytest.mark.parametrize("step", [1, 2, 5, 7, 1000])
def test_the_same_sentences_whatever_the_chunks(step):
    buffer, out = SentenceBuffer(), []
    for i in range(0, len(TEXT), step):
        out += buffer.add(TEXT[i:i + step])
    assert out + [buffer.finish()] == SENTENCES


def test_a_sentence_is_out_as_soon_as_whitespace_follows_its_end():
    buffer = SentenceBuffer()
    assert buffer.add("The door is locked.") == []  # "locked.5" could still come
    assert buffer.add(" The") == ["The door is locked."]
    assert buffer.finish() == "The"


def test_a_run_on_text_is_cut_at_a_space_within_the_limit():
    buffer = SentenceBuffer(max_pending=50)
    pieces = buffer.add("word " * 30)
    assert pieces and all(len(p) <= 50 for p in pieces) and not any(p.endswith("wor") for p in pieces)
