"""OpenAI's POST /v1/audio/transcriptions (multipart), as llama-server takes it, on top of the chat shape.

llama-server (tools/server: convert_transcriptions_to_chatcmpl) turns the upload into one user message: the
request's `prompt`, else the template's ASR preset ("Transcribe audio to text"), plus " (language: xx)" where a
language is named, then the audio at the media marker; its answer is {"type": "transcript.text.done", "text",
"usage"}, streamed as transcript.text.delta events. Hearth answers the same, and the other response formats
OpenAI has: text, verbose_json (duration, one segment, timings), and srt / vtt (one cue over the whole clip: the
model gives no timestamps of its own).
"""

from __future__ import annotations

import base64
import json

from app.protocols import audio
from app.protocols.openai import ApiError, audio_part

# common_chat_get_asr_prompt's user prompt for every template but LFM2's.
ASR_PROMPT = "Transcribe audio to text"
RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


def _number(form: dict, name: str, kind):
    raw = form.get(name)
    if raw in (None, ""):
        return None
    try:
        return kind(raw)
    except ValueError:
        raise ApiError(400, f"'{name}' must be a number, not {str(raw)[:40]!r}", param=name)


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


def _clock(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    return f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


class TranscriptionAdapter:
    """One transcription request: its form fields and file, as a chat request and back."""

    stream_mimetype = "text/event-stream"

    def __init__(self, form: dict, audio: bytes, fmt: str, seconds: float | None, model: str):
        self.form = form
        self.audio = audio
        self.format = fmt
        self.seconds = seconds
        self.model = model
        self.response_format = (form.get("response_format") or "json").lower()
        if self.response_format not in RESPONSE_FORMATS:
            raise ApiError(400, f"'response_format' is {self.response_format!r}: choose one of "
                                f"{', '.join(RESPONSE_FORMATS)}", param="response_format")
        self.stream = str(form.get("stream") or "false").lower() == "true"
        if self.stream and self.response_format != "json":
            raise ApiError(400, "'stream' takes the json response_format only (its events are JSON)", param="stream")
        self.text = ""

    def check(self, limits: audio.AudioLimits) -> audio.AudioInfo:
        """The file checked against the limits (app.protocols.audio.check_audio); its length kept for the answer.

        Separate from the adapter's making so the gateway runs it after admission and off its event loop."""
        info = audio.check_audio(self.audio, self.format, "file", limits)
        self.seconds = info.seconds
        return info

    @property
    def answer_mimetype(self) -> str:
        """The content type of the whole answer in its response_format."""
        return {"text": "text/plain", "srt": "application/x-subrip", "vtt": "text/vtt"}.get(self.response_format,
                                                                                          "application/json")

    def to_openai(self) -> dict:
        """The chat request llama-server makes of the upload (the same prompt, so the same tokens)."""
        prompt = self.form.get("prompt") or ASR_PROMPT
        if self.form.get("language"):
            prompt += f" (language: {self.form['language']})"
        chat = {"model": self.model, "stream": self.stream, **({"stream_options": {"include_usage": True}} if self.stream else {}), "messages": [{"role": "user", "content": [
            {"type": "text", "text": prompt}, audio_part(base64.b64encode(self.audio).decode(), self.format)]}]}
        if self.form.get("hearth_class"):
            chat["hearth_class"] = self.form["hearth_class"]
        temperature = _number(self.form, "temperature", float)
        if temperature is not None:
            chat["temperature"] = temperature
        max_tokens = _number(self.form, "max_tokens", int)
        if max_tokens is not None:
            chat["max_tokens"] = max_tokens
        return chat

    def usage(self, completion: dict) -> dict:
        """llama-server's transcription usage: tokens in and out."""
        u = completion.get("usage") or {}
        return {"type": "tokens", "input_tokens": u.get("prompt_tokens", 0),
                "output_tokens": u.get("completion_tokens", 0), "total_tokens": u.get("total_tokens", 0),
                "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}}

    def answer(self, completion: dict) -> dict | str:
        """The whole answer in the asked response_format (a str for text, srt and vtt)."""
        text = ((completion.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
        if self.response_format == "text":
            return text
        if self.response_format == "srt":
            return f"1\n{_clock(0, ',')} --> {_clock(self.seconds, ',')}\n{text}\n"
        if self.response_format == "vtt":
            return f"WEBVTT\n\n{_clock(0, '.')} --> {_clock(self.seconds, '.')}\n{text}\n"
        out = {"type": "transcript.text.done", "text": text, "usage": self.usage(completion)}
        if self.response_format == "verbose_json":
            out.update({"task": "transcribe", "language": self.form.get("language") or "", "duration": self.seconds,
                        "segments": [{"id": 0, "start": 0.0, "end": self.seconds, "text": text}],
                        "timings": completion.get("timings")})
        return out

    def start(self) -> list[bytes]:
        """Nothing before the first delta."""
        return []

    def feed(self, chunk: dict) -> list[bytes]:
        """A transcript.text.delta per piece of content; the usage chunk closes with transcript.text.done."""
        if "error" in chunk:
            return [_sse(chunk)]
        out = []
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                self.text += piece
                out.append(_sse({"type": "transcript.text.delta", "delta": piece}))
        if chunk.get("usage"):
            out.append(_sse({"type": "transcript.text.done", "text": self.text, "usage": self.usage(chunk)}))
        return out

    def end(self) -> list[bytes]:
        """The stream's close, as the chat stream's."""
        return [b"data: [DONE]\n\n"]

    def error(self, err: ApiError) -> tuple[int, dict]:
        """OpenAI's error shape."""
        return err.status, err.body()


def from_upload(form: dict, data: bytes, limits: audio.AudioLimits | None, model: str) -> TranscriptionAdapter:
    """The adapter of one upload: the file sniffed (wav, mp3 or flac), and checked as an input_audio part is unless
    limits is None (the caller checks it later with adapter.check)."""
    fmt = audio.sniff(data) if data else None
    if fmt is None:
        raise ApiError(400, "'file' is not a WAV, MP3 or FLAC file: send one of those", param="file",
                       code="unsupported_audio_format")
    adapter = TranscriptionAdapter(form, data, fmt, None, model)
    if limits is not None:
        adapter.check(limits)
    return adapter


def read_upload(req, limit: int) -> tuple[dict, bytes]:
    """A werkzeug request's multipart form fields and its `file`, within limit bytes (werkzeug raises its
    RequestEntityTooLarge past it, which the caller's HTTP layer answers as a 413)."""
    from app.protocols.openai import too_large

    try:
        if (req.content_length or 0) > limit:
            raise too_large(limit)
        if not (req.mimetype or "").startswith("multipart/form-data"):
            raise ApiError(400, "send the audio as multipart/form-data with a 'file' field (OpenAI's transcription "
                                "upload)", param="file")
        req.max_content_length = limit
        form, upload = req.form.to_dict(), req.files.get("file")
        if upload is None:
            raise ApiError(400, "no 'file' field: send the audio file as the multipart field 'file'", param="file")
        return form, upload.read()
    finally:
        req.close()  # the parser spools a large upload to a temporary file
