"""POST /v1/audio/transcriptions (and /audio/transcriptions) on the runner: the upload checked as an input_audio
part is (app.protocols.audio), made into llama-server's ASR chat request (app.protocols.transcriptions), and run as
one chat job; the answer in the asked response_format."""

from __future__ import annotations

from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.wrappers import Request as HttpRequest
from werkzeug.wrappers import Response

from app.protocols import transcriptions
from app.protocols.openai import body_limit, too_large
from app.runner import generation
from app.runner.apis import _adapted, _chat_body
from app.runner.job import chat_job
from app.runner.state import RunnerState
from app.runner.transport import event_stream, json_response

PATHS = ("/v1/audio/transcriptions", "/audio/transcriptions")


def on_transcriptions(state: RunnerState, req: HttpRequest) -> Response:
    """POST /v1/audio/transcriptions."""
    limit = body_limit(req.path)
    try:
        form, data = transcriptions.read_upload(req, limit)
    except RequestEntityTooLarge:
        raise too_large(limit)
    adapter = transcriptions.from_upload(form, data, state.config.audio_limits, state.config.model_name)
    body = _chat_body(adapter.to_openai())
    state.ready()
    job = chat_job(state, body, req.headers)
    if job.stream:
        return event_stream(_adapted(adapter, generation.stream(state, req.environ, job)), adapter.stream_mimetype)
    answer = adapter.answer(generation.whole(state, req.environ, [job])[0])
    if isinstance(answer, str):
        return Response(answer, mimetype=adapter.answer_mimetype)
    return json_response(answer)
