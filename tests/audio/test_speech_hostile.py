"""Issue 50 through a real `hearth serve` with an audio model and its Wyoming listener: crafted FLACs leave /healthz
answering, audio too short for the projector is a 400 (or an error event) on every route while another member's
stream goes on, a runner crash gives another member's stream a clear error, and Wyoming's deadlines, caps, event
schemas and member hold."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import sqlite3
import threading
import time

import httpx
import pytest
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error

from app.devtools import audio_files
from app.devtools.audio_mmproj import cached_audio_mmproj
from app.residency.supervisor import free_port
from tests.helpers import SMALL_RUNNERS, run_coroutine, wait_until

AUDIO = "gemma-audio-Q4_K_M"
READ_S = 120
EVENT_TIMEOUT_S = 4

pytestmark = pytest.mark.skipif(bool(audio_files.encoders_missing()), reason="apt-get install flac lame")


@pytest.fixture(scope="module")
def hserve(start_shared_serve, tmp_path_factory, gemma_path):
    """A serve with the audio model, Wyoming on loopback for all of 127.0.0.0/8 (so tests can come from many
    addresses), and a short event deadline."""
    models = tmp_path_factory.mktemp("hostile-models")
    shutil.copyfile(gemma_path, models / f"{AUDIO}.gguf")
    shutil.copyfile(cached_audio_mmproj(gemma_path), models / f"mmproj-{AUDIO}-f32.gguf")
    port = free_port()
    serve = start_shared_serve(models=models, settings={
        **SMALL_RUNNERS, "runner_ctx": 2048, "wyoming_port": port, "wyoming_bind": "127.0.0.1",
        "wyoming_allow": "127.0.0.0/8", "wyoming_event_timeout_s": EVENT_TIMEOUT_S})
    serve.wyoming_port = port
    return serve


def auth(serve, member: str = "alice") -> dict:
    return {"Authorization": f"Bearer {serve.tokens[member]}"}


def upload(serve, data: bytes, member: str = "alice") -> httpx.Response:
    with httpx.Client(base_url=serve.url, timeout=READ_S) as c:
        return c.post("/v1/audio/transcriptions", headers=auth(serve, member),
                      data={"model": AUDIO, "temperature": "0", "max_tokens": "4"}, files={"file": ("clip", data)})


def chat_audio(serve, data: bytes, fmt: str = "wav") -> httpx.Response:
    return serve.client.post("/v1/chat/completions", headers=auth(serve), json={
        "model": AUDIO, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}]}]})


def wav_of(frames: int, rate: int = 16000) -> bytes:
    return audio_files.wav_bytes(audio_files.sweep_pcm(1.0, rate)[:frames], rate)


async def _until(client: AsyncTcpClient, *types):
    while True:
        event = await asyncio.wait_for(client.read_event(), READ_S)
        assert event is not None, "the server closed the connection without an answer"
        for t in types:
            if t.is_type(event.type):
                return t.from_event(event)


def wyoming(serve, pcm: bytes, rate: int = 16000, local: str = "127.0.0.1"):
    """Home Assistant's sequence from a local address; the transcript or the error event."""
    async def run():
        reader, writer = await asyncio.open_connection("127.0.0.1", serve.wyoming_port, local_addr=(local, 0))
        client = AsyncTcpClient("127.0.0.1", serve.wyoming_port)
        client._reader, client._writer = reader, writer
        try:
            await client.write_event(Transcribe(name=AUDIO).event())
            await client.write_event(AudioStart(rate=rate, width=2, channels=1).event())
            for i in range(0, len(pcm), 4096):
                await client.write_event(AudioChunk(rate=rate, width=2, channels=1, audio=pcm[i:i + 4096]).event())
            await client.write_event(AudioStop().event())
            return await _until(client, Transcript, Error)
        finally:
            writer.close()
    return run_coroutine(run())


class Stream(threading.Thread):
    """Another member's streamed chat on the audio model, read to its end in the background."""

    def __init__(self, serve, member: str = "kid"):
        super().__init__(daemon=True)
        self.serve, self.member = serve, member
        self.started = threading.Event()
        self.lines: list[str] = []

    def run(self):
        body = {"model": AUDIO, "stream": True, "max_tokens": 40, "ignore_eos": True, "temperature": 0,
                "messages": [{"role": "user", "content": "Count slowly from one to one hundred."}]}
        with httpx.Client(base_url=self.serve.url, timeout=READ_S) as c, \
                c.stream("POST", "/v1/chat/completions", headers=auth(self.serve, self.member), json=body) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    self.started.set()
                self.lines.append(line)
        self.started.set()

    def errors(self) -> list[dict]:
        return [json.loads(line[6:])["error"] for line in self.lines if line.startswith("data: {") and '"error"' in line]

    def completed(self) -> bool:
        return self.status == 200 and "data: [DONE]" in self.lines and not self.errors()


def runner_pids(serve) -> set[int]:
    return {p.pid for p in serve.runner_arbiters()}


class Healthz(threading.Thread):
    """/healthz asked every 50 ms until stopped; each answer's latency kept, a failure (a timeout) too."""

    def __init__(self, serve, timeout_s: float = 10.0):
        super().__init__(daemon=True)
        self.serve, self.timeout_s = serve, timeout_s
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self):
        with httpx.Client(base_url=self.serve.url, timeout=self.timeout_s) as c:
            while not self.stop.wait(0.05):
                t0 = time.perf_counter()
                try:
                    ok = c.get("/healthz").status_code == 200
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                self.latencies.append(time.perf_counter() - t0)
                if not ok:
                    self.failures.append("not 200")


def test_the_frame_header_flacs_are_answered_while_healthz_keeps_answering(hserve):
    """Issue 50: the 130 KB file held the gateway's one worker for ~116 s (every /healthz timed out)."""
    assert upload(hserve, audio_files.sweep("wav", seconds=1.0)).status_code == 200  # the runner is up first
    probe = Healthz(hserve)
    probe.start()
    try:
        for size in (130_000, 1_000_000):
            r = upload(hserve, audio_files.frame_header_flac(size))
            assert r.status_code == 400 and "cut short" in r.json()["error"]["message"], r.text
        assert chat_audio(hserve, audio_files.frame_header_flac(130_000), "flac").status_code == 400
    finally:
        probe.stop.set()
        probe.join()
    assert probe.latencies and not probe.failures, probe.failures


@pytest.mark.parametrize("frames", [1, 100, 399])
def test_audio_shorter_than_one_window_is_refused_on_every_route_and_another_stream_completes(hserve, frames):
    """Issue 50: a 46-byte one-sample WAV killed the audio runner (GGML_ASSERT in mtmd.cpp), cutting another
    member's stream. The projector is Whisper's: one window is 400 samples at 16 kHz."""
    assert upload(hserve, audio_files.sweep("wav", seconds=1.0)).status_code == 200
    before = runner_pids(hserve)
    stream = Stream(hserve)
    stream.start()
    assert stream.started.wait(READ_S)
    short = wav_of(frames)
    r = upload(hserve, short)
    assert r.status_code == 400 and r.json()["error"]["code"] == "audio_too_short", r.text
    assert "too short for the model's audio encoder" in r.json()["error"]["message"]
    c = chat_audio(hserve, short)
    assert c.status_code == 400 and c.json()["error"]["code"] == "audio_too_short", c.text
    pcm = short[44:]
    answer = wyoming(hserve, pcm)
    assert isinstance(answer, Error) and answer.code == "audio_too_short", answer
    stream.join(READ_S)
    assert stream.completed(), stream.lines[-3:]
    assert runner_pids(hserve) == before  # the same runner: nothing crashed or restarted
    assert upload(hserve, audio_files.sweep("wav", seconds=1.0)).status_code == 200


def test_a_runner_crash_gives_another_members_stream_a_clear_error_and_the_next_request_is_served(hserve):
    """What Hearth does when a runner dies under a stream: the stream ends with a runner_failed error event that
    says the runner will be restarted (no silent cut), and the next request loads it again and is answered."""
    assert upload(hserve, audio_files.sweep("wav", seconds=1.0)).status_code == 200
    stream = Stream(hserve)
    stream.start()
    assert stream.started.wait(READ_S)
    for p in hserve.runner_processes():
        p.kill()
    stream.join(READ_S)
    errors = stream.errors()
    assert errors and errors[0]["code"] == "runner_failed" and "restarted" in errors[0]["message"], stream.lines[-3:]
    assert upload(hserve, audio_files.sweep("wav", seconds=1.0), member="alice").status_code == 200


def test_a_client_trickling_bytes_is_dropped_at_the_event_deadline(hserve):
    """Issue 50: one byte every 20 s kept a connection forever (the idle timer restarted on each byte). Here a byte
    every 0.5 s: each arrives well within any idle timer, the whole event never within its deadline."""
    import socket

    answer = b""
    with socket.create_connection(("127.0.0.1", hserve.wyoming_port)) as sock:
        sock.settimeout(0.5)
        for byte in json.dumps({"type": "describe", "data": {"pad": "x" * 400}}).encode():
            try:
                sock.sendall(bytes([byte]))
                answer = sock.recv(4096)
            except TimeoutError:
                continue
            except ConnectionError:
                pass
            break
        answer += _drain(sock)
    assert b'"type": "error"' in answer and b'"timeout"' in answer, answer


def _drain(sock) -> bytes:
    """What a socket receives until the peer closes or 1 s passes quietly."""
    out = b""
    sock.settimeout(1.0)
    try:
        while chunk := sock.recv(4096):
            out += chunk
    except (TimeoutError, ConnectionError):
        pass
    return out


def _connect_many(port: int, addresses: list[str]) -> list:
    """A connection from each address, each answered a describe (so the listener has counted it) before the next."""
    import socket

    socks = []
    for addr in addresses:
        sock = socket.create_connection(("127.0.0.1", port), source_address=(addr, 0))
        socks.append(sock)
        if len(socks) < len(addresses):
            sock.sendall(b'{"type": "describe"}\n')
            sock.settimeout(READ_S)
            assert b'"type": "info"' in sock.recv(65536)
    return socks


def test_connections_over_the_caps_are_refused_at_once(hserve):
    """Issue 50: 200 idle connections were all accepted. Per address the 9th, in all the 65th is refused with an
    error event as soon as it connects, while the others are held."""
    from app.gateway.wyoming import MAX_CONNECTIONS, MAX_CONNECTIONS_PER_ADDRESS

    per = MAX_CONNECTIONS_PER_ADDRESS
    for addresses in (["127.0.0.1"] * (per + 1),
                      [f"127.0.1.{i // per + 1}" for i in range(MAX_CONNECTIONS)] + ["127.0.2.1"]):
        wait_until(lambda: _idle(hserve), 30, "the earlier connections to close")
        socks = _connect_many(hserve.wyoming_port, addresses)
        try:
            last = _drain(socks[-1])
            assert b'"type": "error"' in last and b'"busy"' in last, last
        finally:
            for sock in socks:
                sock.close()


def _idle(serve) -> bool:
    """Whether Wyoming answers a fresh client (the earlier test's connections gone)."""
    try:
        return isinstance(run_coroutine(_describe(serve.wyoming_port)), object)
    except (OSError, AssertionError, TimeoutError):
        return False


async def _describe(port: int):
    from wyoming.info import Describe, Info

    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Describe().event())
        return await _until(client, Info)


@pytest.mark.parametrize("data", [
    {"rate": "16000", "width": 2, "channels": 1},
    {"width": 2, "channels": 1},
    "deep",
])
def test_malformed_audio_start_is_a_bad_event_error_without_a_traceback(hserve, data):
    async def send():
        async with AsyncTcpClient("127.0.0.1", hserve.wyoming_port) as client:
            line = json.dumps({"type": "audio-start", "data": data}).encode() if data != "deep" else \
                b'{"type": "audio-start", "data": {"rate": ' + b"[" * 5000 + b"]" * 5000 + b"}}"
            client._writer.write(line + b"\n")
            await client._writer.drain()
            return await _until(client, Error)

    log_before = hserve.log_path.read_text(errors="replace")
    error = run_coroutine(send())
    assert error.code in ("bad-event", "bad-stream"), error
    assert "Traceback" not in hserve.log_path.read_text(errors="replace")[len(log_before):]


def test_held_audio_is_capped_in_all_and_the_next_client_is_served(hserve):
    """Issue 50: six clients buffering 19 MiB each grew serve's worker linearly. Here clients from three addresses
    hold 48 kHz stereo audio without audio-stop: two hold 3 MiB each (under the 4 MiB a connection), the third is
    refused with `busy` when the listener's 8 MiB in all are taken."""
    async def hold(local: str, sent: asyncio.Event, release: asyncio.Event):
        reader, writer = await asyncio.open_connection("127.0.0.1", hserve.wyoming_port, local_addr=(local, 0))
        client = AsyncTcpClient("127.0.0.1", hserve.wyoming_port)
        client._reader, client._writer = reader, writer
        try:
            await client.write_event(AudioStart(rate=48000, width=2, channels=2).event())
            for _ in range(96):  # 3 MiB in 32 KiB chunks
                await client.write_event(AudioChunk(rate=48000, width=2, channels=2, audio=bytes(32768)).event())
            sent.set()
            try:
                event = await asyncio.wait_for(client.read_event(), 1.0)
            except TimeoutError:
                await release.wait()
                return None
            return Error.from_event(event) if event is not None and Error.is_type(event.type) else event
        except ConnectionError:
            sent.set()
            return "reset"
        finally:
            writer.close()

    async def run():
        release = asyncio.Event()
        sent = [asyncio.Event() for _ in range(3)]
        holders = [asyncio.create_task(hold(f"127.0.3.{i + 1}", sent[i], release)) for i in range(2)]
        await asyncio.wait_for(asyncio.gather(sent[0].wait(), sent[1].wait()), 30)
        third = await hold("127.0.3.3", sent[2], release)
        release.set()
        return await asyncio.gather(*holders), third

    (first, second), third = run_coroutine(run())
    assert first is None and second is None, (first, second)
    assert isinstance(third, Error) and third.code == "busy", third
    assert isinstance(wyoming(hserve, wav_of(16000)[44:]), Transcript)


def test_wyoming_counts_as_a_member_of_the_store_whose_removal_takes_its_prompts(hserve):
    from app.services.privacy import remove_member
    from app.store.db import make_engine, session_factory

    pcm = wav_of(16000)[44:]
    assert isinstance(wyoming(hserve, pcm), Transcript)
    db = hserve.data / "hearth.db"

    def rows():
        with sqlite3.connect(db) as c:
            return c.execute("select count(*) from requests where member_name = 'wyoming'").fetchone()[0]

    wait_until(lambda: rows() > 0, 30, "the Wyoming request's row")
    with sqlite3.connect(db) as c:
        assert c.execute("select count(*) from members where name = 'wyoming'").fetchone()[0] == 1
    engine = make_engine(db)
    try:
        with session_factory(engine)() as s:
            removal = remove_member(s, hserve.data, "wyoming")
    finally:
        engine.dispose()
    assert removal.requests_cleared > 0 and rows() == 0
