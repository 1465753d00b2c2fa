"""POST /v1/audio/transcriptions (and /audio/transcriptions) on the runner: the upload checked as an input_audio
part is (app.runner.audio), made into llama-server's ASR chat request (app.protocols.transcriptions), and run as one
chat job; the answer in the asked response_format."""

from __future__ import annotations

from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.wrappers import Request as HttpRequest
from werkzeug.wrappers import Response

from app.protocols.openai import ApiError, body_limit, too_large
from app.protocols.transcriptions import TranscriptionAdapter
from app.runner import audio, generation
from app.runner.apis import _adapted, _chat_body
from app.runner.job import chat_job
from app.runner.state import RunnerState
from app.runner.transport import event_stream, json_response

PATHS = ("/v1/audio/transcriptions", "/audio/transcriptions")


def read_upload(req: HttpRequest) -> tuple[dict, bytes]:
    """The multipart form's fields and its `file`, within the route's body limit."""
    limit = body_limit(req.path)
    if (req.content_length or 0) > limit:
        raise too_large(limit)
    if not (req.mimetype or "").startswith("multipart/form-data"):
        raise ApiError(400, "send the audio as multipart/form-data with a 'file' field (OpenAI's transcription "
                            "upload)", param="file")
    req.max_content_length = limit
    try:
        form, files = req.form.to_dict(), req.files
    except RequestEntityTooLarge:
        raise too_large(limit)
    try:
        upload = files.get("file")
        if upload is None:
            raise ApiError(400, "no 'file' field: send the audio file as the multipart field 'file'", param="file")
        return form, upload.read()
    finally:
        req.close()  # the parser spools a large upload to a temporary file


def on_transcriptions(state: RunnerState, req: HttpRequest) -> Response:
    """POST /v1/audio/transcriptions."""
    form, data = read_upload(req)
    fmt = audio.sniff(data) or "unknown"
    if fmt == "unknown":
        raise ApiError(400, "'file' is not a WAV, MP3 or FLAC file: send one of those", param="file",
                       code="unsupported_audio_format")
    info = audio.check_audio(data, fmt, "file", state.config.audio)
    adapter = TranscriptionAdapter(form, data, fmt, info.seconds, state.config.model_name)
    body = _chat_body(adapter.to_openai())
    state.ready()
    job = chat_job(state, body, req.headers)
    if job.stream:
        return event_stream(_adapted(adapter, generation.stream(state, req.environ, job)), adapter.stream_mimetype)
    answer = adapter.answer(generation.whole(state, req.environ, [job])[0])
    if isinstance(answer, str):
        mimetype = {"srt": "application/x-subrip", "vtt": "text/vtt"}.get(adapter.response_format, "text/plain")
        return Response(answer, mimetype=mimetype)
    return json_response(answer)
