"""OpenAI's POST /v1/audio/speech: its body, the checks that make bad input a clear 400, and its SSE events.

The body is OpenAI's: `model`, `input` (at most MAX_INPUT_CHARS, as OpenAI limits it), `voice`, `response_format`
(wav, mp3, flac, opus, pcm; mp3 by default), `speed` (0.25-4.0), `stream_format` ("audio": the file's bytes as they
are written, chunked; "sse": `speech.audio.delta` events with base64 audio, then `speech.audio.done` with usage)
and `instructions` (taken, not used: Piper has no style prompt). OpenAI's own voice names (alloy, ash, ...) mean
the default voice, so the official client works unchanged; any other name must be a voice serve has.
"""

from __future__ import annotations

import base64
import json
import unicodedata
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.protocols.openai import ApiError

MAX_INPUT_CHARS = 4096
FORMATS = ("wav", "mp3", "flac", "opus", "pcm")
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer",
                           "verse", "marin", "cedar"})
OPENAI_MODELS = frozenset({"tts-1", "tts-1-hd", "gpt-4o-mini-tts"})
# Whitespace a text to speak may hold; every other control character is refused (a client's bug, or an attack on
# the phonemizer), and named by its code point.
_ALLOWED_CONTROLS = frozenset("\n\r\t")


class SpeechBody(BaseModel):
    """POST /v1/audio/speech."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(default=None, max_length=256)
    input: str
    voice: str | None = Field(default=None, max_length=256)
    response_format: str = "mp3"
    speed: float = 1.0
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = Field(default=None, max_length=MAX_INPUT_CHARS)
    hearth_class: str | None = None


def check(body: SpeechBody, formats: list[str]) -> None:
    """A 400 in OpenAI's shape for what no voice can speak: empty or over-long input, a control character, a format
    that is not OpenAI's or that this machine cannot write, a speed out of range."""
    check_text(body.input)
    if body.response_format not in FORMATS:
        raise ApiError(400, f"'response_format' is {body.response_format[:40]!r}: choose one of {', '.join(FORMATS)}",
                       param="response_format", code="unsupported_format")
    if body.response_format not in formats:
        raise ApiError(400, f"'response_format' {body.response_format!r} needs an encoder this server does not have "
                            f"(mp3: apt-get install lame; flac: flac; opus: libsndfile1); it can write {', '.join(formats)}",
                       param="response_format", code="unsupported_format")
    if not 0.25 <= body.speed <= 4.0:
        raise ApiError(400, f"'speed' is {body.speed:g}: choose 0.25 to 4.0", param="speed", code="speed_out_of_range")


def check_text(text: str, field: str = "input") -> None:
    """A 400 for text no voice should speak: empty, over MAX_INPUT_CHARS, or with a control character."""
    if not text.strip():
        raise ApiError(400, f"'{field}' is empty: send the text to speak", param=field, code="empty_input")
    if len(text) > MAX_INPUT_CHARS:
        raise ApiError(400, f"'{field}' is {len(text):,} characters, over the limit of {MAX_INPUT_CHARS:,}: split it "
                            "into several requests", param=field, code="input_too_long")
    bad = next((i for i, c in enumerate(text) if c not in _ALLOWED_CONTROLS and unicodedata.category(c) in ("Cc", "Cs")),
               None)
    if bad is not None:
        raise ApiError(400, f"'{field}' has the control character U+{ord(text[bad]):04X} at position {bad}: send plain "
                            "text (newlines and tabs are fine)", param=field, code="control_character")


def voice_name(body: SpeechBody) -> str | None:
    """The voice the request names: `voice`, else a `model` that is not one of OpenAI's; None: the default voice."""
    for name in (body.voice, body.model):
        if name and name not in OPENAI_VOICES and name not in OPENAI_MODELS:
            return name
    return None


def unknown_voice(name: str, known: list[str]) -> ApiError:
    """A 400 for a voice serve does not have, naming the ones it has."""
    return ApiError(400, f"unknown voice '{name[:80]}'; voices here: {', '.join(known) or 'none'} (or one of OpenAI's "
                         "names, which speak with the default voice)", param="voice", code="unknown_voice")


def delta_event(audio: bytes) -> bytes:
    """One `speech.audio.delta` SSE event."""
    return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode()})


def done_event(characters: int, audio_seconds: float) -> bytes:
    """The closing `speech.audio.done` event: usage in characters in, audio seconds out (Piper has no tokens)."""
    return _sse({"type": "speech.audio.done", "usage": {"input_tokens": characters, "output_tokens": 0,
                                                        "total_tokens": characters,
                                                        "audio_seconds": round(audio_seconds, 3)}})


def error_event(message: str) -> bytes:
    """An `error` event: the synthesis failed after the answer began."""
    return _sse({"type": "error", "error": {"message": message, "type": "server_error", "code": "tts_failed"}})


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()
