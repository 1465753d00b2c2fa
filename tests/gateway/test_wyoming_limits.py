"""The Wyoming listener's own limits without a model (app.gateway.wyoming): every event's data against its schema,
a deadline on each whole event however slowly its bytes come, and the caps on connections and held audio."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from wyoming.audio import AudioChunk, AudioStart
from wyoming.event import Event

from app.gateway.wyoming import (
    MAX_PAYLOAD_BYTES,
    StreamError,
    _Audio,
    _Budget,
    _Connections,
    _Late,
    _read_event,
    _Reader,
    check_event_data,
)
from app.protocols.audio import AudioLimits


@pytest.mark.parametrize(("data", "says"), [
    ({"rate": "16000", "width": 2, "channels": 1}, "'rate' must be an integer"),
    ({"width": 2, "channels": 1}, "has no 'rate'"),
    ({"rate": True, "width": 2, "channels": 1}, "'rate' must be an integer"),
    ({"rate": 16000, "width": 2, "channels": 10**30}, "out of range"),
    ({"rate": 16000, "width": [2], "channels": 1}, "'width' must be an integer"),
])
def test_malformed_audio_start_data_is_a_bad_event(data, says):
    with pytest.raises(StreamError) as caught:
        check_event_data(Event(type="audio-start", data=data))
    assert caught.value.code == "bad-event" and says in str(caught.value)


def test_well_formed_events_and_unknown_types_pass():
    check_event_data(AudioStart(rate=16000, width=2, channels=1).event())
    check_event_data(AudioChunk(rate=16000, width=2, channels=1, audio=b"\0\0").event())
    check_event_data(Event(type="transcribe", data={"name": "m", "language": "en"}))
    check_event_data(Event(type="ping", data={"anything": [1, {"x": None}]}))
    with pytest.raises(StreamError):
        check_event_data(Event(type="transcribe", data={"language": "x" * 500}))


@pytest.fixture
def sent():
    """Factory: a reader over a socket whose peer has sent `payload` and closed; every socket closed after."""
    opened = []

    def make(payload: bytes) -> _Reader:
        a, b = socket.socketpair()
        opened.extend((a, b))
        b.sendall(payload)
        b.shutdown(socket.SHUT_WR)
        return _Reader(a)

    yield make
    for sock in opened:
        sock.close()


def test_deep_nesting_in_a_header_is_a_stream_error_not_a_recursion_error(sent):
    line = b'{"type": "audio-start", "data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    with pytest.raises(StreamError):
        _read_event(sent(line[:16 * 1024] + b"\n"), time.monotonic() + 5)
    nested = b'{"type": "x", "data": {"a": ' + b"[" * 5000 + b"]" * 5000 + b"}}\n"
    with pytest.raises(StreamError) as caught:
        _read_event(sent(nested), time.monotonic() + 5)
    assert "not JSON" in str(caught.value)


def test_lengths_over_the_payload_limit_are_refused_before_reading(sent):
    header = json.dumps({"type": "audio-chunk", "payload_length": MAX_PAYLOAD_BYTES + 1}).encode() + b"\n"
    with pytest.raises(StreamError):
        _read_event(sent(header), time.monotonic() + 5)


def test_a_trickled_event_runs_out_of_its_deadline():
    """One byte at a time: each recv succeeds (an idle timer would restart forever), the event's deadline does not."""
    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle():
        for byte in b'{"type": "describe"}':
            if stop.wait(0.2):
                return
            b.send(bytes([byte]))

    t = threading.Thread(target=trickle)
    t.start()
    try:
        with pytest.raises(_Late):
            _read_event(_Reader(a), time.monotonic() + 0.5)
    finally:
        stop.set()
        t.join()
        a.close()
        b.close()


def test_connections_are_capped_in_all_and_per_address():
    conns = _Connections(max_total=3, max_per_address=2)
    assert conns.enter("10.0.0.1") is None and conns.enter("10.0.0.1") is None
    assert "10.0.0.1 has 2" in conns.enter("10.0.0.1")
    assert conns.enter("10.0.0.2") is None
    assert "its 3 clients" in conns.enter("10.0.0.3")
    conns.leave("10.0.0.1")
    assert conns.enter("10.0.0.3") is None
    assert conns.by_address == {"10.0.0.1": 1, "10.0.0.2": 1, "10.0.0.3": 1}


def test_held_audio_is_capped_per_connection_and_in_all():
    budget = _Budget(3000)
    start = AudioStart(rate=16000, width=2, channels=1)
    first, second = _Audio(start, AudioLimits(max_seconds=60), budget), _Audio(start, AudioLimits(max_seconds=60), budget)
    chunk = AudioChunk(rate=16000, width=2, channels=1, audio=bytes(1000))
    first.add(chunk)
    first.add(chunk)
    second.add(chunk)
    with pytest.raises(StreamError) as caught:
        second.add(chunk)
    assert caught.value.code == "busy" and budget.held == 3000
    first.release()
    second.add(chunk)
    assert budget.held == 2000
    small = _Audio(start, AudioLimits(max_seconds=0.05), _Budget(10**9))  # 1,600 bytes of 16 kHz 16-bit
    small.add(chunk)
    with pytest.raises(StreamError) as caught:
        small.add(chunk)
    assert caught.value.code == "audio-too-long"
