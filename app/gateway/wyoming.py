"""A Wyoming speech-to-text and text-to-speech server inside `hearth serve`, for Home Assistant's Assist pipeline (off
by default).

Wyoming (the `wyoming` package, Home Assistant's own protocol for local speech services) is JSON-line events over
TCP: `describe` → `info`; `transcribe`, `audio-start`, `audio-chunk`…, `audio-stop` → `transcript`. It has no
authentication, so the listener takes only clients on its allow list (setting `wyoming_allow`; by default the
household's private ranges and loopback), binds where `wyoming_bind` says, and refuses anything else with an `error`
event before a byte of audio is read. The collected audio becomes a WAV and goes through the gateway's own
transcription path (app.gateway.pipeline: class admission, routing, the request log) in the voice class, as the
member `wyoming`. A malformed, oversized or out-of-order stream gets an `error` event and its connection is closed;
the listener goes on serving the next client.

Wyoming has no token, so its limits are the listener's own: every event's data is checked against a schema (a
wrong type is a `bad-event` error, never a traceback); each whole event must arrive within wyoming_event_timeout_s
and an utterance within wyoming_utterance_timeout_s (a client trickling a byte at a time runs out, where an idle
timer that restarts on each byte never did); at most MAX_CONNECTIONS clients at once and
MAX_CONNECTIONS_PER_ADDRESS from one address (the next is refused at once); at most MAX_BUFFER_BYTES of audio
held a connection and MAX_TOTAL_BUFFER_BYTES in all (past it a `busy` error). Transcriptions count as the member
the setting wyoming_member names (a row of the store, created on first use), so its limits, the Members page and
the member's removal (its request-log text and cached prompts) apply to Wyoming as to any token.

Text to speech (app.gateway.speech's path: the same class, member, admission and request log): `describe` lists the
Piper voices with `supports_synthesize_streaming`; `synthesize` is answered with audio-start, audio-chunk…,
audio-stop; a streamed synthesis (synthesize-start, synthesize-chunk…, synthesize-stop) speaks each sentence as soon
as the chunks complete it (app.speech.sentences), each as its own audio-start…audio-stop, then synthesize-stopped.
The `synthesize` Home Assistant also sends inside a stream (for servers without streaming) is ignored there, as
Piper's own Wyoming server does. A stream's text has the utterance's deadline and at most MAX_STREAM_CHARS.

Under serve's gevent worker the socketserver's threads are greenlets and its sockets cooperative.
"""

from __future__ import annotations

import io
import ipaddress
import json
import logging
import socket
import socketserver
import threading
import time
import wave
from typing import Any

from sqlalchemy import insert, select
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, write_event
from wyoming.info import AsrModel, AsrProgram, Attribution, Describe, Info, TtsProgram, TtsVoice, TtsVoiceSpeaker
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStopped

from app.gateway.auth import Principal
from app.gateway.members import MemberLimits
from app.gateway.pipeline import from_lan, serve_generation
from app.gateway.speech import SpeechJob, relay_frames, start
from app.protocols import transcriptions
from app.protocols.audio import AudioLimits
from app.protocols.openai import ApiError, ChatBody
from app.protocols.speech import MAX_INPUT_CHARS, check_text
from app.speech.client import SpeechFailed
from app.speech.sentences import SentenceBuffer
from app.store.models import Member, utcnow

log = logging.getLogger(__name__)

MEMBER = "wyoming"
# The largest event header line and data/payload a client may send: an audio chunk is a few KB (Home Assistant
# sends 1,024 samples of 16-bit audio), and 50 clients reading one at once must not move serve's memory.
MAX_LINE_BYTES = 16 * 1024
MAX_PAYLOAD_BYTES = 64 * 1024
# Clients at once, and from one address: a household has a few satellites, each one connection an utterance.
MAX_CONNECTIONS = 64
MAX_CONNECTIONS_PER_ADDRESS = 8
# A connection's whole life: describe, one or a few utterances.
MAX_CONNECTION_S = 600.0
# Audio held before audio-stop, a connection and in all: 60 s of Home Assistant's 16 kHz 16-bit mono is 1.9 MB.
MAX_BUFFER_BYTES = 4 * 1024 * 1024
MAX_TOTAL_BUFFER_BYTES = 8 * 1024 * 1024
# What a rate, width or channel count may be in an audio event (checked before any arithmetic on them).
MAX_EVENT_RATE = 192000
MAX_NAME_CHARS = 128
# An Assist utterance lasts seconds: a minute is plenty, and keeps a stuck satellite from filling serve's memory.
MAX_SECONDS = 60.0
# After an error event, what the client still sends is read and dropped for this long before the socket closes:
# closing on unread bytes resets the connection, and the client would lose the error event with it.
LINGER_S = 2.0
WIDTHS = (1, 2, 4)
ATTRIBUTION = Attribution(name="Hearth", url="https://github.com/ggml-org/llama.cpp")
PIPER = Attribution(name="Piper (GPL-3.0)", url="https://github.com/OHF-Voice/piper1-gpl")
# A synthesize event's text, as the speech API takes it; a streamed synthesis's text in all (a long answer).
MAX_STREAM_CHARS = 64 * 1024
# Samples in one audio-chunk sent back: 1,024 of 16-bit mono, as Piper's own Wyoming server sends.
SPEECH_CHUNK_BYTES = 2048
_TTS_EVENTS = ("synthesize", "synthesize-start", "synthesize-chunk", "synthesize-stop")


class StreamError(Exception):
    """A client's event stream broke the protocol or the limits: the message goes back as an `error` event."""

    def __init__(self, message: str, code: str = "bad-stream"):
        super().__init__(message)
        self.code = code


def allowed(addr: str, allow: str) -> bool:
    """Whether a client address is on the allow list (comma-separated IPs or CIDRs; empty: private and loopback)."""
    addr = addr.removeprefix("::ffff:")
    entries = [e.strip() for e in (allow or "").split(",") if e.strip()]
    if not entries:
        return from_lan(addr)
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    for entry in entries:
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


class _Late(Exception):
    """The client's deadline passed before its event was whole."""


class _Reader:
    """The connection's bytes, read with a deadline: each recv waits only for what is left of it, so a client that
    sends one byte at a time cannot stretch an event past its deadline."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def _fill(self, deadline: float) -> bool:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Late
        self.sock.settimeout(left)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            raise _Late from None
        if not chunk:
            return False
        self.buf += chunk
        return True

    def readline(self, limit: int, deadline: float) -> bytes:
        """One line (with its newline), at most limit + 1 bytes; what is left at the end of the stream."""
        while (end := self.buf.find(b"\n")) < 0:
            if len(self.buf) > limit or not self._fill(deadline):
                end = len(self.buf) - 1
                break
        line = bytes(self.buf[:end + 1])
        del self.buf[:end + 1]
        return line

    def read(self, n: int, deadline: float) -> bytes:
        """n bytes, or fewer where the stream ends first."""
        while len(self.buf) < n and self._fill(deadline):
            pass
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def _read_event(reader: _Reader, deadline: float) -> Event | None:
    """One event as Wyoming frames it (a JSON header line, then its data and payload bytes), or None at the end.

    The package's own read_event answers None for a malformed event, as for a closed stream, and trusts the lengths
    a header states: here a malformed header or a length over the limits is a StreamError the client is told of."""
    line = reader.readline(MAX_LINE_BYTES, deadline)
    if not line:
        return None
    if len(line) > MAX_LINE_BYTES:
        raise StreamError(f"an event header is over {MAX_LINE_BYTES:,} bytes")
    header = _json(line, "the header line")
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise StreamError("not a Wyoming event: the header has no type")
    data = header.get("data") or {}
    lengths = [header.get("data_length") or 0, header.get("payload_length") or 0]
    if not isinstance(data, dict) or not all(type(n) is int and 0 <= n <= MAX_PAYLOAD_BYTES for n in lengths):
        raise StreamError(f"an event's data or lengths are malformed or over {MAX_PAYLOAD_BYTES:,} bytes")
    parts = []
    for n in lengths:
        part = reader.read(n, deadline) if n else b""
        if len(part) < n:
            raise StreamError("the connection closed inside an event")
        parts.append(part)
    if parts[0]:
        extra = _json(parts[0], "an event's data")
        if not isinstance(extra, dict):
            raise StreamError("an event's data is not a JSON object")
        data = {**data, **extra}
    return Event(type=header["type"], data=data, payload=parts[1] or None)


def _json(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        raise StreamError(f"not a Wyoming event: {what} is not JSON") from None


# Each event type's data fields Hearth reads: (name, types, required). Checked before the package's classes see
# them, so a "rate": "16000" is a bad-event error instead of a TypeError deep in a comparison.
_FORMAT = (("rate", int, True), ("width", int, True), ("channels", int, True), ("timestamp", int, False))
_SCHEMAS: dict[str, tuple[tuple[str, type, bool], ...]] = {
    "audio-start": _FORMAT,
    "audio-chunk": _FORMAT,
    "audio-stop": (("timestamp", int, False),),
    "transcribe": (("name", str, False), ("language", str, False)),
    "describe": (),
    "synthesize": (("text", str, True),),
    "synthesize-chunk": (("text", str, True),),
}


def check_event_data(event: Event) -> None:
    """A StreamError (code bad-event) where an event Hearth reads has a field of the wrong type or size."""
    for name, kind, required in _SCHEMAS.get(event.type, ()):
        value = event.data.get(name)
        if value is None:
            if required:
                raise StreamError(f"{event.type} has no '{name}'", "bad-event")
            continue
        if type(value) is not kind:  # not isinstance: a bool is no rate
            raise StreamError(f"{event.type}'s '{name}' must be {'an integer' if kind is int else 'a string'}, "
                              f"not {json.dumps(value)[:40]}", "bad-event")
        if kind is int and not 0 <= value <= (1 << 62 if name == "timestamp" else MAX_EVENT_RATE):
            raise StreamError(f"{event.type}'s '{name}' is out of range: {value}", "bad-event")
        limit = MAX_INPUT_CHARS if name == "text" else MAX_NAME_CHARS
        if kind is str and len(value) > limit:
            raise StreamError(f"{event.type}'s '{name}' is over {limit:,} characters", "bad-event")
    if event.type in _TTS_EVENTS:
        _check_voice(event)


def _check_voice(event: Event) -> None:
    voice = event.data.get("voice")
    if voice is None:
        return
    if not isinstance(voice, dict) or not all(type(voice.get(k)) is str and len(voice[k]) <= MAX_NAME_CHARS
                                              for k in ("name", "language", "speaker") if voice.get(k) is not None):
        raise StreamError(f"{event.type}'s 'voice' must be an object of short strings (name, language, speaker)",
                          "bad-event")


def _voice_name(voice) -> str | None:
    return voice.name if voice is not None else None


class _TextStream:
    """A streamed synthesis: its voice, and its text held until a sentence is complete."""

    def __init__(self, voice: str | None):
        self.voice = voice
        self.sentences = SentenceBuffer()
        self.chars = 0

    def add(self, text: str) -> list[str]:
        """The sentences this chunk completes."""
        self.chars += len(text)
        if self.chars > MAX_STREAM_CHARS:
            raise StreamError(f"the streamed text is over {MAX_STREAM_CHARS:,} characters", "text-too-long")
        return self.sentences.add(text)


class _Budget:
    """Audio bytes held by every connection together, within a cap."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.held = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Hold n more bytes, if the cap allows."""
        with self._lock:
            if self.held + n > self.max_bytes:
                return False
            self.held += n
            return True

    def give(self, n: int) -> None:
        """Give back n held bytes."""
        with self._lock:
            self.held -= n


class _Connections:
    """Clients connected now, in all and per address, within the caps."""

    def __init__(self, max_total: int, max_per_address: int):
        self.max_total, self.max_per_address = max_total, max_per_address
        self.by_address: dict[str, int] = {}
        self._lock = threading.Lock()

    def enter(self, ip: str) -> str | None:
        """Count a new client in; the reason it is refused, or None."""
        with self._lock:
            if sum(self.by_address.values()) >= self.max_total:
                return f"Hearth's Wyoming server has its {self.max_total} clients already: try again shortly"
            if self.by_address.get(ip, 0) >= self.max_per_address:
                return f"{ip} has {self.max_per_address} Wyoming connections open already: close one first"
            self.by_address[ip] = self.by_address.get(ip, 0) + 1
            return None

    def leave(self, ip: str) -> None:
        """Count a client out."""
        with self._lock:
            left = self.by_address.get(ip, 1) - 1
            if left:
                self.by_address[ip] = left
            else:
                self.by_address.pop(ip, None)


class _Audio:
    """One utterance: its format from audio-start, its samples from the chunks, held to the limits."""

    def __init__(self, start: AudioStart, limits: AudioLimits, budget: _Budget):
        if not limits.min_sample_rate <= start.rate <= limits.max_sample_rate or start.width not in WIDTHS \
                or not 1 <= start.channels <= 2:
            raise StreamError(f"audio-start says {start.rate} Hz, {start.width} bytes a sample, {start.channels} "
                              f"channels: send {limits.min_sample_rate:,}-{limits.max_sample_rate:,} Hz, 1, 2 or 4 "
                              "bytes a sample, mono or stereo", "bad-audio")
        self.start = start
        self.max_bytes = int(min(limits.max_seconds * start.rate * start.width * start.channels, limits.max_bytes,
                                 MAX_BUFFER_BYTES))
        self.limits = limits
        self.budget = budget
        self.pcm = bytearray()

    def add(self, chunk: AudioChunk) -> None:
        """Append a chunk's samples, within the connection's and the listener's caps."""
        if (chunk.rate, chunk.width, chunk.channels) != (self.start.rate, self.start.width, self.start.channels):
            raise StreamError("an audio-chunk's format differs from its audio-start's", "bad-audio")
        if len(self.pcm) + len(chunk.audio) > self.max_bytes:
            raise StreamError(f"the audio is over the limit of {self.limits.max_seconds:,.0f} s or "
                              f"{self.max_bytes:,} bytes", "audio-too-long")
        if not self.budget.take(len(chunk.audio)):
            raise StreamError("Hearth holds as much Wyoming audio as it may for other clients now: try again "
                              "shortly", "busy")
        self.pcm += chunk.audio

    def release(self) -> None:
        """Give the held audio back to the listener's budget."""
        self.budget.give(len(self.pcm))
        self.pcm = bytearray()

    def wav(self) -> bytes:
        """The utterance as a WAV file."""
        out = io.BytesIO()
        with wave.open(out, "wb") as w:
            w.setnchannels(self.start.channels)
            w.setsampwidth(self.start.width)
            w.setframerate(self.start.rate)
            w.writeframes(self.pcm)
        return out.getvalue()


class _Handler(socketserver.StreamRequestHandler):
    server: WyomingServer

    def handle(self) -> None:
        ip = self.client_address[0]
        if not allowed(ip, self.server.allow_list()):
            log.warning("wyoming: refused %s (not on the allow list)", ip)
            self._refuse(Error(text=f"{ip} is not on Hearth's Wyoming allow list (setting wyoming_allow)",
                               code="not-allowed"))
            return
        crowded = self.server.connections.enter(ip)
        if crowded is not None:
            self._refuse(Error(text=crowded, code="busy"))
            return
        try:
            self._serve(ip)
        except StreamError as err:
            self._refuse(Error(text=str(err), code=err.code))
        except _Late:
            self._refuse(Error(text="the client took too long to send its event or utterance", code="timeout"))
        except (TimeoutError, ConnectionError):
            pass
        except Exception as exc:  # the listener outlives one client's bad luck
            log.exception("wyoming: %s's connection failed", ip)
            self._refuse(Error(text=f"Hearth could not answer: {exc}", code="internal"))
        finally:
            self.server.connections.leave(ip)

    def _refuse(self, error: Error) -> None:
        """Send the error event, then drop what the client still sends until it closes (or LINGER_S passes)."""
        self._send(error.event())
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_S)
            deadline = time.monotonic() + LINGER_S
            while time.monotonic() < deadline and self.connection.recv(65536):
                pass
        except OSError:
            pass

    def _serve(self, ip: str) -> None:
        reader = _Reader(self.connection)
        event_s, utterance_s = self.server.timeouts()
        closing = time.monotonic() + MAX_CONNECTION_S
        language: str | None = None
        model: str | None = None
        audio: _Audio | None = None
        text: _TextStream | None = None
        utterance_end = closing
        try:
            while True:
                event = _read_event(reader, min(time.monotonic() + event_s, utterance_end, closing))
                if event is None:
                    return
                check_event_data(event)
                if Describe.is_type(event.type):
                    self._send(self.server.info().event())
                elif event.type in _TTS_EVENTS:
                    text = self._synthesis(event, text, ip)
                    if SynthesizeStart.is_type(event.type):
                        utterance_end = min(time.monotonic() + utterance_s, closing)
                    elif text is None:
                        utterance_end = closing
                elif Transcribe.is_type(event.type):
                    asked = Transcribe.from_event(event)
                    language, model = asked.language, asked.name
                elif AudioStart.is_type(event.type):
                    if audio is not None:
                        audio.release()
                    audio = _Audio(AudioStart.from_event(event), self.server.limits, self.server.budget)
                    utterance_end = min(time.monotonic() + utterance_s, closing)
                elif AudioChunk.is_type(event.type):
                    if audio is None:
                        raise StreamError("an audio-chunk came before audio-start", "bad-order")
                    audio.add(AudioChunk.from_event(event))
                elif AudioStop.is_type(event.type):
                    if audio is None:
                        raise StreamError("audio-stop came before audio-start", "bad-order")
                    wav = audio.wav()
                    audio.release()
                    audio, utterance_end = None, closing
                    self._send(self.server.transcribe(wav, language, model, ip))
        finally:
            if audio is not None:
                audio.release()

    def _synthesis(self, event: Event, stream: _TextStream | None, ip: str) -> _TextStream | None:
        """A text-to-speech event: the stream it leaves (None: no streamed synthesis is open)."""
        if SynthesizeStart.is_type(event.type):
            return _TextStream(_voice_name(SynthesizeStart.from_event(event).voice))
        if Synthesize.is_type(event.type):
            if stream is None:  # inside a stream it is Home Assistant's copy for servers that cannot stream
                asked = Synthesize.from_event(event)
                self.server.speak(asked.text, _voice_name(asked.voice), ip, self._send)
            return stream
        if stream is None:
            raise StreamError(f"{event.type} came before synthesize-start", "bad-order")
        if SynthesizeChunk.is_type(event.type):
            for sentence in stream.add(SynthesizeChunk.from_event(event).text):
                self.server.speak(sentence, stream.voice, ip, self._send)
            return stream
        if rest := stream.sentences.finish():
            self.server.speak(rest, stream.voice, ip, self._send)
        self._send(SynthesizeStopped().event())
        return None

    def _send(self, event: Event) -> None:
        try:
            write_event(event, self.wfile)
            self.wfile.flush()
        except OSError:
            pass


class WyomingServer(socketserver.ThreadingTCPServer):
    """The listener: one thread (a greenlet under gevent) per client."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, app, bind: str, port: int):
        super().__init__((bind, port), _Handler)
        self.app = app
        self.limits = AudioLimits(max_seconds=MAX_SECONDS)
        self.budget = _Budget(MAX_TOTAL_BUFFER_BYTES)
        self.connections = _Connections(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_ADDRESS)
        self._member: tuple[float, Principal] | None = None
        self._thread: threading.Thread | None = None

    def _services(self):
        from app.gateway.context import services

        return services(self.app)

    def allow_list(self) -> str:
        """The allow-list setting as it is now."""
        return str(self._services().settings.get("wyoming_allow") or "")

    def timeouts(self) -> tuple[float, float]:
        """(each event's, each utterance's) deadline in seconds, from the settings."""
        settings = self._services().settings
        return float(settings.get("wyoming_event_timeout_s")), float(settings.get("wyoming_utterance_timeout_s"))

    def principal(self, default_class: str) -> Principal:
        """Who Wyoming's transcriptions count as: the member wyoming_member names, with its stored limits; the row
        is created on first use, so the Members page lists it and its removal takes its prompts with it."""
        svc = self._services()
        name = str(svc.settings.get("wyoming_member") or MEMBER)
        cached = self._member
        if cached is not None and cached[0] > time.monotonic() and cached[1].member == name \
                and cached[1].default_class == default_class:
            return cached[1]
        with svc.sessions() as s:
            row = s.scalar(select(Member).where(Member.name == name))
            found = (row.id, MemberLimits.of(row)) if row is not None else None
        if found is None:
            def store(session) -> None:
                # OR IGNORE: a member of that name made meanwhile (the admin, another connection) is kept as it is.
                session.execute(insert(Member).prefix_with("OR IGNORE").values(name=name, created_at=utcnow()))

            svc.writer.submit(store)
            found = (None, MemberLimits())
        principal = Principal(token_id=None, member=name, default_class=default_class, allowed_classes=(),
                              limits=found[1], member_id=found[0])
        # Re-read every few seconds, as tokens are: limits edited (or the member removed) elsewhere then apply.
        self._member = (time.monotonic() + (5.0 if found[0] is not None else 0.0), principal)
        return principal

    def audio_models(self) -> list[str]:
        """The catalog's models with an audio encoder beside them."""
        from app.gguf_meta import projector_modalities

        return [e.name for e in self._services().catalog.entries if e.mmproj is not None
                and projector_modalities(e.mmproj)[1]]

    def info(self) -> Info:
        """What `describe` answers: one ASR program with the audio models serve has, one TTS program with its voices."""
        models = [AsrModel(name=name, description=f"{name} through Hearth's voice class", attribution=ATTRIBUTION,
                           installed=True, languages=[], version=None) for name in self.audio_models()]
        speech = self._services().speech
        voices = [TtsVoice(name=v.name, description=f"{v.name} ({v.quality}, {v.sample_rate:,} Hz)", attribution=PIPER,
                           installed=True, version=None, languages=[v.language],
                           speakers=[TtsVoiceSpeaker(name=n) for n in v.speakers] or None)
                  for v in (speech.voices() if speech is not None else []) if v.error is None]
        tts = [TtsProgram(name="hearth-piper", description="Hearth: Piper text to speech on the household's LLM server",
                          attribution=PIPER, installed=True, version=None, voices=voices,
                          supports_synthesize_streaming=True)] if voices else []
        return Info(asr=[AsrProgram(name="hearth", description="Hearth: speech to text on the household's LLM server",
                                    attribution=ATTRIBUTION, installed=True, version=None, models=models)], tts=tts)

    def speak(self, text: str, voice_name: str | None, ip: str, send) -> None:
        """One text through the speech path in the Wyoming class: audio-start, its audio-chunks, audio-stop."""
        svc = self._services()
        voice = svc.speech.find(voice_name) if svc.speech is not None else None
        if voice is None:
            raise StreamError(f"no voice '{voice_name}' here" if voice_name else "no voice: install the tts extra",
                              "unknown-voice")
        klass = str(svc.settings.get("wyoming_class") or "voice")
        policy = svc.classes.get(klass)
        if policy is None:
            raise StreamError(f"the class '{klass}' (setting wyoming_class) does not exist", "no-class")
        try:
            check_text(text, "text")
            ex, frames = start(svc, SpeechJob(self.principal(klass), policy, voice, text, "raw"))
        except ApiError as err:
            raise StreamError(err.message, err.code or "refused")
        send(AudioStart(rate=voice.sample_rate, width=2, channels=1).event())
        try:
            for pcm in relay_frames(ex, frames):
                for i in range(0, len(pcm), SPEECH_CHUNK_BYTES):
                    send(AudioChunk(rate=voice.sample_rate, width=2, channels=1,
                                    audio=pcm[i:i + SPEECH_CHUNK_BYTES]).event())
        except SpeechFailed as exc:
            raise StreamError(str(exc), "tts-failed")
        send(AudioStop().event())

    def transcribe(self, wav: bytes, language: str | None, model: str | None, ip: str) -> Event:
        """The utterance through the gateway's transcription path in the voice class: a transcript or an error."""
        models = self.audio_models()
        name = model if model in models else (models[0] if models else None)
        if name is None:
            return Error(text="no model with an audio projector: add one to the models folder", code="no-model").event()
        form: dict[str, Any] = {"model": name, "temperature": "0", "response_format": "json"}
        if language:
            form["language"] = language
        voice = str(self._services().settings.get("wyoming_class") or "voice")
        principal = self.principal(voice)
        with self.app.test_request_context("/v1/audio/transcriptions", method="POST",
                                           environ_base={"REMOTE_ADDR": ip}):
            try:
                # Checked by serve_generation once admitted, off the loop, against the model's encoder window.
                adapter = transcriptions.from_upload(form, wav, None, name)
                response = serve_generation(ChatBody, "/v1/chat/completions", adapter, principal=principal)
                body = response.get_json(silent=True) or {}
                status = response.status_code
            except ApiError as err:
                return Error(text=err.message, code=err.code or "refused").event()
        if status != 200:
            message = (body.get("error") or {}).get("message") or f"HTTP {status}"
            return Error(text=message, code=f"http-{status}").event()
        return Transcript(text=body.get("text", "")).event()

    def start(self) -> WyomingServer:
        """Serve in the background; returns self."""
        self._thread = threading.Thread(target=self.serve_forever, name="hearth-wyoming", daemon=True)
        self._thread.start()
        log.info("wyoming: listening on %s:%d", *self.server_address[:2])
        return self

    def stop(self) -> None:
        """Stop accepting and close the listening socket."""
        self.shutdown()
        self.server_close()
