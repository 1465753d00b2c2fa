"""Wyoming text to speech inside a real `hearth serve` with the real embedded Piper voice, driven by the `wyoming`
package's own client in Home Assistant's orders: describe (voices, streaming supported); synthesize → audio-start,
chunks, audio-stop; a streamed synthesis in 5-character chunks whose first sentence is spoken before the rest of
the text is sent; bad streams get an error event and the next client is served; the syntheses are in the log."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

from app.residency.supervisor import free_port
from app.speech.voices import embedded_voice
from tests.helpers import ServeStarter, run_coroutine, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.skipif(embedded_voice() is None, reason="pip install 'hearth[tts]'")]
TIMEOUT_S = 120
ANSWER = "The lights are off. The door is locked. Good night!"


@pytest.fixture(scope="module")
def wserve(tmp_path_factory, standin_model):
    starter = ServeStarter(tmp_path_factory.mktemp, standin_model)
    port = free_port()
    serve = starter(settings={"tts_threads": 1, "wyoming_port": port, "wyoming_bind": "127.0.0.1",
                              "wyoming_allow": "127.0.0.1"})
    serve.wyoming_port = port
    yield serve
    starter.stop_all()


async def _read(client: AsyncTcpClient) -> Event:
    event = await asyncio.wait_for(client.read_event(), TIMEOUT_S)
    assert event is not None, "the server closed the connection"
    return event


async def _audio(client: AsyncTcpClient) -> tuple[AudioStart, bytes]:
    """One spoken piece: audio-start, its chunks, audio-stop."""
    event = await _read(client)
    assert AudioStart.is_type(event.type), event
    start, pcm = AudioStart.from_event(event), b""
    while not AudioStop.is_type((event := await _read(client)).type):
        assert AudioChunk.is_type(event.type), event
        pcm += AudioChunk.from_event(event).audio
    return start, pcm


def test_describe_lists_the_voices_with_streaming(wserve):
    async def run():
        async with AsyncTcpClient("127.0.0.1", wserve.wyoming_port) as client:
            await client.write_event(Describe().event())
            return Info.from_event(await _read(client))

    (program,) = run_coroutine(run()).tts
    assert program.supports_synthesize_streaming and program.installed
    voice = program.voices[0]
    assert voice.name == embedded_voice().name and voice.languages == ["en_US"]


def test_synthesize_answers_audio_start_chunks_and_stop(wserve):
    async def run():
        async with AsyncTcpClient("127.0.0.1", wserve.wyoming_port) as client:
            await client.write_event(Synthesize(text=ANSWER, voice=SynthesizeVoice(name=embedded_voice().name)).event())
            return await _audio(client)

    start, pcm = run_coroutine(run())
    assert (start.rate, start.width, start.channels) == (22050, 2, 1)
    assert 2.0 < len(pcm) / 2 / start.rate < 15.0


def test_streamed_text_is_spoken_sentence_by_sentence_before_it_has_all_arrived(wserve):
    first, rest = ANSWER[:25], ANSWER[25:]  # the first sentence and a piece of the second

    async def run():
        async with AsyncTcpClient("127.0.0.1", wserve.wyoming_port) as client:
            await client.write_event(SynthesizeStart().event())
            for i in range(0, len(first), 5):
                await client.write_event(SynthesizeChunk(text=first[i:i + 5]).event())
            # The first sentence is complete: its audio comes while the rest of the text is still unsent.
            pieces = [await _audio(client)]
            for i in range(0, len(rest), 5):
                await client.write_event(SynthesizeChunk(text=rest[i:i + 5]).event())
            # Home Assistant's copy of the whole text for servers that cannot stream: ignored inside a stream.
            await client.write_event(Synthesize(text=ANSWER).event())
            await client.write_event(SynthesizeStop().event())
            while not SynthesizeStopped.is_type((event := await _read(client)).type):
                assert AudioStart.is_type(event.type), event
                pcm = b""
                while not AudioStop.is_type((event := await _read(client)).type):
                    pcm += AudioChunk.from_event(event).audio
                pieces.append((None, pcm))
            return pieces

    pieces = run_coroutine(run())
    assert len(pieces) == 3 and all(len(pcm) > 22050 * 2 * 0.3 for _, pcm in pieces)


@pytest.mark.parametrize(("events", "code"), [
    ([SynthesizeChunk(text="Hello.").event()], "bad-order"),
    ([Synthesize(text="ring \x07 bell").event()], "control_character"),
    ([Synthesize(text="  ").event()], "empty_input"),
    ([Synthesize(text="Hi.", voice=SynthesizeVoice(name="no-such-voice")).event()], "unknown-voice"),
    ([Event(type="synthesize", data={"text": 5})], "bad-event"),
    ([Event(type="synthesize", data={"text": "x" * 5000})], "bad-event"),
])
def test_a_bad_synthesis_gets_an_error_event_and_the_next_client_is_served(wserve, events, code):
    async def run(to_send):
        async with AsyncTcpClient("127.0.0.1", wserve.wyoming_port) as client:
            for event in to_send:
                await client.write_event(event)
            while True:
                event = await _read(client)
                if Error.is_type(event.type) or AudioStop.is_type(event.type):
                    return event

    answer = run_coroutine(run(events))
    assert Error.is_type(answer.type) and Error.from_event(answer).code == code
    assert AudioStop.is_type(run_coroutine(run([Synthesize(text="Still here.").event()])).type)


def test_syntheses_are_logged_as_the_wyoming_member_in_the_voice_class(wserve):
    def rows():
        with sqlite3.connect(wserve.data / "hearth.db") as db:
            return db.execute("select class_name, status, input_chars, audio_seconds from requests where "
                              "member_name = 'wyoming' and features = 'speech'").fetchall()

    async def run():
        async with AsyncTcpClient("127.0.0.1", wserve.wyoming_port) as client:
            await client.write_event(Synthesize(text="Logged.").event())
            return await _audio(client)

    run_coroutine(run())
    found = wait_until(lambda: [r for r in rows() if r[2] == len("Logged.")], timeout_s=30)
    assert found[0][:2] == ("voice", "ok") and found[0][3] > 0
