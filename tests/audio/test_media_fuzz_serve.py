"""The media fuzz tier through a real `hearth serve` (issue 50; model tier: it loads the embedded model twice, once
with the random audio projector, once with the random vision one). Every seeded variant of
app.devtools.media_fuzz goes through the routes that take it: audio through the upload, chat's input_audio and
Wyoming (its bytes as the utterance's samples), images through chat's image_url. /healthz is asked every 50 ms
throughout. Found nothing if: every answer is a 200 or a 4xx, /healthz never failed, and no runner died (the same
runner processes at the end, no crash in the residency log). `hearth bench speech-attack` prints the stall figures."""

from __future__ import annotations

import base64
import shutil
import sqlite3

import httpx
import pytest
from wyoming.asr import Transcript
from wyoming.error import Error

from app.devtools import audio_files
from app.devtools.audio_mmproj import cached_audio_mmproj
from app.devtools.media_fuzz import variants
from app.devtools.mmproj import cached_mmproj
from app.protocols import audio
from app.protocols.openai import ApiError
from app.residency.supervisor import free_port
from tests.audio.test_speech_hostile import AUDIO, Healthz, wyoming
from tests.helpers import SMALL_RUNNERS

VISION = "gemma-vision-Q4_K_M"
# The full suite's share: the fast tier runs the fixed cases and 80 mutations without a serve. A variant the checks
# refuse goes through every route (a 400 each, cheap); one they pass is encoded by the runner, so it goes through one
# route, in turn (the fast tier shows the routes' checks agree).
SERVE_COUNT = 40
ROUTES = ("upload", "chat", "wyoming")

pytestmark = pytest.mark.skipif(bool(audio_files.encoders_missing()), reason="apt-get install flac lame")


@pytest.fixture(scope="module")
def fserve(start_shared_serve, tmp_path_factory, gemma_path):
    models = tmp_path_factory.mktemp("fuzz-models")
    for name, projector in ((AUDIO, cached_audio_mmproj(gemma_path)), (VISION, cached_mmproj(gemma_path))):
        shutil.copyfile(gemma_path, models / f"{name}.gguf")
        shutil.copyfile(projector, models / f"mmproj-{name}-f32.gguf")
    port = free_port()
    serve = start_shared_serve(models=models, settings={
        **SMALL_RUNNERS, "runner_ctx": 2048, "wyoming_port": port, "wyoming_bind": "127.0.0.1",
        "wyoming_allow": "127.0.0.1"})
    serve.wyoming_port = port
    return serve


def _passes_checks(v) -> bool:
    try:
        audio.check_audio(v.data, v.fmt, "file", audio.AudioLimits().for_projector("qwen2a"))
        return True
    except ApiError:
        return False


def _send(client: httpx.Client, serve, v, routes=ROUTES) -> list:
    headers = {"Authorization": f"Bearer {serve.tokens['alice']}"}
    b64 = base64.b64encode(v.data).decode()
    if not v.is_audio:
        r = client.post("/v1/chat/completions", headers=headers, json={"model": VISION, "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/{v.fmt};base64,{b64}"}}]}]})
        return [r.status_code]
    out: list = []
    if "upload" in routes:
        out.append(client.post("/v1/audio/transcriptions", headers=headers, data={"model": AUDIO, "max_tokens": "1"},
                               files={"file": (f"f.{v.fmt}", v.data)}).status_code)
    if "chat" in routes:
        out.append(client.post("/v1/chat/completions", headers=headers, json={
            "model": AUDIO, "max_tokens": 1, "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": b64, "format": v.fmt}}]}]}).status_code)
    if "wyoming" in routes:
        # Its bytes as the utterance's 16-bit samples: all of them (to 1 MiB) where it is its one route, else its
        # first 399 samples at most (under one window: refused before the runner, as the files' checks refuse).
        pcm = v.data[:1 << 20] if len(routes) == 1 else v.data[:798]
        event = wyoming(serve, pcm[: len(pcm) // 2 * 2])
        assert isinstance(event, Transcript | Error), (v.name, event)
        out.append(event.code if isinstance(event, Error) else "transcript")
    return out


def test_no_variant_stalls_serve_or_kills_a_runner(fserve):
    with httpx.Client(base_url=fserve.url, timeout=300) as client:
        # Both runners loaded first: a load is no stall of the fuzzed checks.
        assert _send(client, fserve, next(v for v in variants(0, 0) if v.name == "wav-400-frames"))[:2] == [200, 200]
        assert _send(client, fserve, next(v for v in variants(0, 0) if v.name == "png-1x1")) == [200]
        pids = {p.pid for p in fserve.runner_arbiters()}
        probe = Healthz(fserve)
        probe.start()
        answers: dict[str, list] = {}
        try:
            for i, v in enumerate(variants(seed=1, count=SERVE_COUNT)):
                routes = (ROUTES[i % 3],) if v.is_audio and _passes_checks(v) else ROUTES
                answers[v.name] = _send(client, fserve, v, routes)
        finally:
            probe.stop.set()
            probe.join()
    bad = {name: codes for name, codes in answers.items()
           if any(isinstance(c, int) and not (c == 200 or 400 <= c < 500) for c in codes)}
    assert not bad, bad
    assert probe.latencies and not probe.failures, probe.failures
    assert {p.pid for p in fserve.runner_arbiters()} == pids
    with sqlite3.connect(fserve.data / "hearth.db") as db:
        assert db.execute("select count(*) from residency_events where event = 'crash'").fetchone()[0] == 0
    print(f"media fuzz through serve: {len(answers)} variants, /healthz max {max(probe.latencies) * 1000:.0f} ms "
          f"over {len(probe.latencies)} probes")
