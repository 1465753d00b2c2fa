"""Audio in a generation, checked at the gateway: after admission (a member's limits apply before any work on its
bytes) and off serve's event loop (app.residency.offload: a pool thread decodes and walks the file while the loop
serves every other connection), against the encoder window of the model's own projector.

Whatever runs the model — hearth runner, stock llama-server, a remote node — a file that libmtmd would assert on
(too short for one window, a lying length) is refused here with a 400 and never reaches it. The hearth runner
checks again (app.runner.prompts), for clients that reach it directly.
"""

from __future__ import annotations

import os
from functools import lru_cache

from app.gguf_meta import audio_projector_type
from app.protocols import audio
from app.protocols.openai import ApiError
from app.protocols.transcriptions import TranscriptionAdapter
from app.residency.offload import off_loop


@lru_cache(maxsize=64)
def _projector_type(path: str, mtime_ns: int) -> str | None:
    return audio_projector_type(path)


def audio_limits(svc, model_name: str) -> audio.AudioLimits:
    """The audio limits of a model: its projector's encoder window where serve pairs one, else the strictest."""
    limits = audio.AudioLimits()
    entry = next((e for e in svc.catalog.entries if e.name == model_name), None)
    mmproj = getattr(entry, "mmproj", None)
    if mmproj is None:
        return limits
    try:
        kind = _projector_type(str(mmproj), os.stat(mmproj).st_mtime_ns)
    except OSError:
        return limits
    return limits.for_projector(kind)


def check_generation_audio(svc, model_name: str, adapter, raw: dict) -> float | None:
    """Check the request's audio (an upload's file, or a chat's input_audio parts) off the event loop; a 400 for a
    file the model's runner must not see. Returns the upload's length in seconds (None: no upload)."""
    limits = audio_limits(svc, model_name)
    if isinstance(adapter, TranscriptionAdapter):
        return off_loop(adapter.check, limits).seconds
    parts = audio.audio_parts(raw.get("messages") or [])
    if not parts:
        return None
    if len(parts) > limits.max_parts:
        raise ApiError(400, f"'messages': {len(parts)} audio parts, more than the limit of {limits.max_parts} a "
                            "request", param="messages", code="too_many_audio_parts")
    off_loop(_load_all, parts, limits)
    return None


def _load_all(parts: list[tuple[dict, str]], limits: audio.AudioLimits) -> None:
    for part, where in parts:
        audio.load_audio(part, where, limits)
