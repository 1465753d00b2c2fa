"""The Wyoming speech-to-text server inside a real `hearth serve`, driven by the `wyoming` package's own client in
the order Home Assistant's Wyoming integration uses: describe → info (at setup), then transcribe, audio-start, the
chunks, audio-stop, and events read until the transcript. A client off the allow list, a malformed or oversized
stream: an error event, nothing transcribed, and the next client is served."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import wave
from io import BytesIO

import pytest
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.info import Describe, Info

from app.devtools import audio_files
from app.devtools.audio_mmproj import cached_audio_mmproj
from app.residency.supervisor import free_port
from tests.helpers import SMALL_RUNNERS, run_coroutine, wait_until

AUDIO = "gemma-audio-Q4_K_M"
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def wserve(start_shared_serve, tmp_path_factory, gemma_path):
    """A serve with an audio model and its Wyoming listener on a free port (loopback only on the allow list)."""
    models = tmp_path_factory.mktemp("wyoming-models")
    shutil.copyfile(gemma_path, models / f"{AUDIO}.gguf")
    shutil.copyfile(cached_audio_mmproj(gemma_path), models / f"mmproj-{AUDIO}-f32.gguf")
    port = free_port()
    serve = start_shared_serve(models=models, settings={**SMALL_RUNNERS, "runner_ctx": 2048, "wyoming_port": port,
                                                        "wyoming_bind": "127.0.0.1", "wyoming_allow": "127.0.0.1"})
    serve.wyoming_port = port
    return serve


def pcm_of(data: bytes) -> tuple[bytes, int]:
    with wave.open(BytesIO(data)) as w:
        return w.readframes(w.getnframes()), w.getframerate()


async def _until(client: AsyncTcpClient, *types) -> object:
    while True:
        event = await asyncio.wait_for(client.read_event(), TIMEOUT_S)
        assert event is not None, "the server closed the connection"
        for t in types:
            if t.is_type(event.type):
                return t.from_event(event)


async def describe(port: int) -> Info:
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Describe().event())
        return await _until(client, Info)


async def transcribe(port: int, pcm: bytes, rate: int, chunk: int = 2048, start: AudioStart | None = None):
    """Home Assistant's order: transcribe, audio-start, chunks, audio-stop; then the transcript (or an error)."""
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Transcribe(name=AUDIO, language="en").event())
        await client.write_event((start or AudioStart(rate=rate, width=2, channels=1)).event())
        for i in range(0, len(pcm), chunk):
            await client.write_event(AudioChunk(rate=rate, width=2, channels=1, audio=pcm[i:i + chunk]).event())
        await client.write_event(AudioStop().event())
        return await _until(client, Transcript, Error)


def wyoming_rows(serve) -> list[tuple]:
    with sqlite3.connect(serve.data / "hearth.db") as db:
        return db.execute("select class_name, status, prompt_tokens from requests where member_name = 'wyoming' "
                          "order by id").fetchall()


def test_describe_lists_the_audio_model(wserve):
    info = run_coroutine(describe(wserve.wyoming_port))
    assert [p.name for p in info.asr] == ["hearth"]
    assert [m.name for m in info.asr[0].models] == [AUDIO] and info.asr[0].installed


def test_home_assistants_sequence_gets_a_transcript_through_the_voice_class(wserve):
    before = len(wyoming_rows(wserve))
    pcm, rate = pcm_of(audio_files.sweep("wav", seconds=2.0))
    answer = run_coroutine(transcribe(wserve.wyoming_port, pcm, rate))
    assert isinstance(answer, Transcript), answer
    # The request log is written off the serving path (the store's one writer): wait for the row.
    wait_until(lambda: len(wyoming_rows(wserve)) > before, 30, "the transcription's row in the request log")
    rows = wyoming_rows(wserve)[before:]
    # Through the gateway's own path: one request-log row, in the voice class, with the audio's ~750 positions.
    assert len(rows) == 1 and rows[0][0] == "voice" and rows[0][1] == "ok" and rows[0][2] > 750, rows


@pytest.mark.parametrize(("case", "code"), [
    ("oversized", "audio-too-long"),
    ("bad format", "bad-audio"),
    ("chunk first", "bad-order"),
    ("garbage", "bad-stream"),
])
def test_a_bad_stream_gets_an_error_event_and_the_next_client_is_served(wserve, case, code):
    before = len(wyoming_rows(wserve))

    async def bad() -> object:
        async with AsyncTcpClient("127.0.0.1", wserve.wyoming_port) as client:
            if case == "oversized":  # more than the 60 s limit of 16 kHz 16-bit mono, in 1 s chunks
                await client.write_event(AudioStart(rate=16000, width=2, channels=1).event())
                for _ in range(65):
                    await client.write_event(AudioChunk(rate=16000, width=2, channels=1, audio=bytes(32000)).event())
            elif case == "bad format":
                await client.write_event(AudioStart(rate=16000, width=3, channels=6).event())
            elif case == "chunk first":
                await client.write_event(AudioChunk(rate=16000, width=2, channels=1, audio=bytes(640)).event())
            else:
                client._writer.write(b"this is no JSON event\n")
                await client._writer.drain()
            return await _until(client, Error)

    error = run_coroutine(bad())
    assert error.code == code, error
    assert len(wyoming_rows(wserve)) == before  # nothing went to a runner
    pcm, rate = pcm_of(audio_files.sweep("wav", seconds=1.0))
    assert isinstance(run_coroutine(transcribe(wserve.wyoming_port, pcm, rate)), Transcript)


def test_a_client_off_the_allow_list_gets_an_error_and_nothing_is_encoded(wserve):
    # The listener is bound to loopback and allows 127.0.0.1 only: 127.0.0.2 is another host as far as it knows.
    before = len(wyoming_rows(wserve))

    async def from_elsewhere() -> object:
        reader, writer = await asyncio.open_connection("127.0.0.1", wserve.wyoming_port, local_addr=("127.0.0.2", 0))
        client = AsyncTcpClient("127.0.0.1", wserve.wyoming_port)
        client._reader, client._writer = reader, writer
        try:
            pcm, rate = pcm_of(audio_files.sweep("wav", seconds=1.0))
            try:
                await client.write_event(Transcribe(name=AUDIO).event())
                await client.write_event(AudioStart(rate=rate, width=2, channels=1).event())
                await client.write_event(AudioChunk(rate=rate, width=2, channels=1, audio=pcm).event())
                await client.write_event(AudioStop().event())
            except ConnectionError:
                pass  # the server answered and closed before the rest was written
            return await _until(client, Error, Transcript)
        finally:
            writer.close()

    answer = run_coroutine(from_elsewhere())
    assert isinstance(answer, Error) and answer.code == "not-allowed" and "127.0.0.2" in answer.text, answer
    assert len(wyoming_rows(wserve)) == before
