"""OpenAI's POST /v1/audio/transcriptions (and /audio/transcriptions) on the gateway, through the household's classes;
its blueprint routes /v1/audio/speech too (app.gateway.speech).

Relayed like the vendors' routes (app.gateway.pipeline: token, class, admission, route, record) through
app.protocols.transcriptions' adapter: the upload is checked here (a bad file never reaches a runner), becomes
llama-server's ASR chat request, and the chat route of whichever runner serves the model answers it — hearth runner
or stock llama-server alike. The class is the token's, or the one the request names (hearth_class form field or
the X-Hearth-Class header), as for any other request.
"""

from __future__ import annotations

from flask import Blueprint, request

from app.gateway import bodies
from app.gateway.pipeline import authenticate, serve_generation
from app.gateway.speech import speak
from app.protocols import transcriptions
from app.protocols.openai import ChatBody, body_limit

bp = Blueprint("audio", __name__)
bodies.install(bp, bodies.openai_shape)


def transcribe():
    """A transcription through the household's classes."""
    # The token first: a client without one is answered before a byte of its upload is read.
    principal = authenticate()
    form, data = transcriptions.read_upload(request, body_limit(request.path))
    # Checked by serve_generation once the request is admitted, off the event loop (app.gateway.media).
    adapter = transcriptions.from_upload(form, data, None, form.get("model") or "")
    return serve_generation(ChatBody, "/v1/chat/completions", adapter, principal=principal)


for _path in ("/v1/audio/transcriptions", "/audio/transcriptions"):
    bp.add_url_rule(_path, f"transcribe{_path.count('/')}", transcribe, methods=["POST"])

for _path in ("/v1/audio/speech", "/audio/speech"):
    bp.add_url_rule(_path, f"speak{_path.count('/')}", speak, methods=["POST"])
