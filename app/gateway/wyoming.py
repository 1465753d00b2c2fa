"""A Wyoming speech-to-text server inside `hearth serve`, for Home Assistant's Assist pipeline (off by default).

Wyoming (the `wyoming` package, Home Assistant's own protocol for local speech services) is JSON-line events over
TCP: `describe` → `info`; `transcribe`, `audio-start`, `audio-chunk`…, `audio-stop` → `transcript`. It has no
authentication, so the listener takes only clients on its allow list (setting `wyoming_allow`; by default the
household's private ranges and loopback), binds where `wyoming_bind` says, and refuses anything else with an `error`
event before a byte of audio is read. The collected audio becomes a WAV and goes through the gateway's own
transcription path (app.gateway.pipeline: class admission, routing, the request log) in the voice class, as the
member `wyoming`. A malformed, oversized or out-of-order stream gets an `error` event and its connection is closed;
the listener goes on serving the next client.

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

from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, write_event
from wyoming.info import AsrModel, AsrProgram, Attribution, Describe, Info

from app.gateway.auth import Principal
from app.gateway.pipeline import from_lan, serve_generation
from app.protocols import transcriptions
from app.protocols.audio import AudioLimits
from app.protocols.openai import ApiError, ChatBody

log = logging.getLogger(__name__)

MEMBER = "wyoming"
# The largest event header line and data/payload a client may send: an audio chunk is a few KB.
MAX_LINE_BYTES = 64 * 1024
MAX_PAYLOAD_BYTES = 1024 * 1024
# A client that sends nothing for this long (a satellite gone mid-stream, a half-open socket) is closed.
IDLE_TIMEOUT_S = 30.0
# An Assist utterance lasts seconds: a minute is plenty, and keeps a stuck satellite from filling serve's memory.
MAX_SECONDS = 60.0
# After an error event, what the client still sends is read and dropped for this long before the socket closes:
# closing on unread bytes resets the connection, and the client would lose the error event with it.
LINGER_S = 2.0
WIDTHS = (1, 2, 4)
ATTRIBUTION = Attribution(name="Hearth", url="https://github.com/ggml-org/llama.cpp")


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


def _read_event(reader) -> Event | None:
    """One event as Wyoming frames it (a JSON header line, then its data and payload bytes), or None at the end.

    The package's own read_event answers None for a malformed event, as for a closed stream, and trusts the lengths
    a header states: here a malformed header or a length over the limits is a StreamError the client is told of."""
    line = reader.readline(MAX_LINE_BYTES + 1)
    if not line:
        return None
    if len(line) > MAX_LINE_BYTES:
        raise StreamError(f"an event header is over {MAX_LINE_BYTES:,} bytes")
    try:
        header = json.loads(line)
    except ValueError:
        raise StreamError("not a Wyoming event: the header line is not JSON") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise StreamError("not a Wyoming event: the header has no type")
    data = header.get("data") or {}
    lengths = [header.get("data_length") or 0, header.get("payload_length") or 0]
    if not isinstance(data, dict) or not all(isinstance(n, int) and 0 <= n <= MAX_PAYLOAD_BYTES for n in lengths):
        raise StreamError(f"an event's data or lengths are malformed or over {MAX_PAYLOAD_BYTES:,} bytes")
    parts = []
    for n in lengths:
        part = reader.read(n) if n else b""
        if len(part) < n:
            raise StreamError("the connection closed inside an event")
        parts.append(part)
    if parts[0]:
        try:
            data = {**data, **json.loads(parts[0])}
        except (ValueError, TypeError):
            raise StreamError("an event's data is not a JSON object") from None
    return Event(type=header["type"], data=data, payload=parts[1] or None)


class _Audio:
    """One utterance: its format from audio-start, its samples from the chunks, held to the limits."""

    def __init__(self, start: AudioStart, limits: AudioLimits):
        if not limits.min_sample_rate <= start.rate <= limits.max_sample_rate or start.width not in WIDTHS \
                or not 1 <= start.channels <= 2:
            raise StreamError(f"audio-start says {start.rate} Hz, {start.width} bytes a sample, {start.channels} "
                              f"channels: send {limits.min_sample_rate:,}-{limits.max_sample_rate:,} Hz, 1, 2 or 4 "
                              "bytes a sample, mono or stereo", "bad-audio")
        self.start = start
        self.max_bytes = int(min(limits.max_seconds * start.rate * start.width * start.channels, limits.max_bytes))
        self.limits = limits
        self.pcm = bytearray()

    def add(self, chunk: AudioChunk) -> None:
        if (chunk.rate, chunk.width, chunk.channels) != (self.start.rate, self.start.width, self.start.channels):
            raise StreamError("an audio-chunk's format differs from its audio-start's", "bad-audio")
        self.pcm += chunk.audio
        if len(self.pcm) > self.max_bytes:
            raise StreamError(f"the audio is over the limit of {self.limits.max_seconds:,.0f} s or "
                              f"{self.limits.max_bytes:,} bytes", "audio-too-long")

    def wav(self) -> bytes:
        out = io.BytesIO()
        with wave.open(out, "wb") as w:
            w.setnchannels(self.start.channels)
            w.setsampwidth(self.start.width)
            w.setframerate(self.start.rate)
            w.writeframes(bytes(self.pcm))
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
        self.connection.settimeout(IDLE_TIMEOUT_S)
        try:
            self._serve(ip)
        except StreamError as err:
            self._refuse(Error(text=str(err), code=err.code))
        except (TimeoutError, ConnectionError):
            pass
        except Exception as exc:  # the listener outlives one client's bad luck
            log.exception("wyoming: %s's connection failed", ip)
            self._refuse(Error(text=f"Hearth could not answer: {exc}", code="internal"))

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
        reader = self.rfile
        language: str | None = None
        model: str | None = None
        audio: _Audio | None = None
        while True:
            event = _read_event(reader)
            if event is None:
                return
            if Describe.is_type(event.type):
                self._send(self.server.info().event())
            elif Transcribe.is_type(event.type):
                asked = Transcribe.from_event(event)
                language, model = asked.language, asked.name
            elif AudioStart.is_type(event.type):
                audio = _Audio(AudioStart.from_event(event), self.server.limits)
            elif AudioChunk.is_type(event.type):
                if audio is None:
                    raise StreamError("an audio-chunk came before audio-start", "bad-order")
                audio.add(AudioChunk.from_event(event))
            elif AudioStop.is_type(event.type):
                if audio is None:
                    raise StreamError("audio-stop came before audio-start", "bad-order")
                self._send(self.server.transcribe(audio.wav(), language, model, ip))
                audio = None

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
        self._thread: threading.Thread | None = None

    def _services(self):
        from app.gateway.context import services

        return services(self.app)

    def allow_list(self) -> str:
        return str(self._services().settings.get("wyoming_allow") or "")

    def audio_models(self) -> list[str]:
        """The catalog's models with an audio encoder beside them."""
        from app.gguf_meta import projector_modalities

        return [e.name for e in self._services().catalog.entries if e.mmproj is not None
                and projector_modalities(e.mmproj)[1]]

    def info(self) -> Info:
        """What `describe` answers: one ASR program with the audio models serve has."""
        models = [AsrModel(name=name, description=f"{name} through Hearth's voice class", attribution=ATTRIBUTION,
                           installed=True, languages=[], version=None) for name in self.audio_models()]
        return Info(asr=[AsrProgram(name="hearth", description="Hearth: speech to text on the household's LLM server",
                                    attribution=ATTRIBUTION, installed=True, version=None, models=models)])

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
        principal = Principal(token_id=None, member=MEMBER, default_class=voice, allowed_classes=())
        with self.app.test_request_context("/v1/audio/transcriptions", method="POST",
                                           environ_base={"REMOTE_ADDR": ip}):
            try:
                adapter = transcriptions.from_upload(form, wav, self.limits, name)
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
