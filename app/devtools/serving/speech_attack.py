"""`hearth bench speech-attack`: issue 50's attacks on the speech surfaces of a real `hearth serve` (default settings,
an audio projector paired with the model, Wyoming on loopback), with the figures its targets name:

- the 130 KB and 1 MB frame-header FLACs: each check's time in-process, each upload's answer time, and /healthz's
  latency (max, p99) probed every 50 ms throughout (targets: < 100 ms each, /healthz within 100 ms);
- one-sample, 100-sample and one-window-minus-one WAVs: the status on the upload route while another member's
  stream runs, whether that stream completed, whether the runner's pid stayed the same;
- Wyoming: how long a client trickling a byte every --trickle-s seconds stays connected; how many of --connections
  connections (from distinct loopback addresses) are refused and how fast; serve's RSS before, at its peak and
  after while --clients clients each try to buffer --client-mib MiB of audio (target: < 20 MiB growth).
"""

from __future__ import annotations

import asyncio
import json
import platform
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from app.devtools import audio_files
from app.devtools.audio_mmproj import cached_audio_mmproj
from app.devtools.serve_process import ServeProcess, prepare_data
from app.protocols.audio import AudioLimits, check_audio
from app.protocols.openai import ApiError
from app.residency.supervisor import free_port

AUDIO = "speech-attack-audio"


def add_arguments(parser) -> None:
    """The bench's options."""
    parser.add_argument("--model", default=None, help="text model GGUF (default: the embedded model)")
    parser.add_argument("--connections", type=int, default=201, help="Wyoming connections opened (default %(default)s)")
    parser.add_argument("--clients", type=int, default=50, help="Wyoming clients buffering audio (default %(default)s)")
    parser.add_argument("--client-mib", type=float, default=20, help="MiB each tries to buffer (default %(default)s)")
    parser.add_argument("--trickle-s", type=float, default=20, help="seconds between a trickling client's bytes")
    parser.add_argument("--skip-trickle", action="store_true", help="leave out the trickle (it takes the event deadline)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the figures here")


class _Probe(threading.Thread):
    """/healthz every 50 ms; latencies (s) and failures kept."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.latencies, self.failures, self.stop = url, [], [], threading.Event()

    def run(self):
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self.stop.wait(0.05):
                t0 = time.perf_counter()
                try:
                    c.get("/healthz").raise_for_status()
                    self.latencies.append(time.perf_counter() - t0)
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))

    def summary(self) -> dict:
        lat = sorted(self.latencies) or [float("nan")]
        return {"probes": len(self.latencies), "failures": len(self.failures), "max_ms": lat[-1] * 1000,
                "p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1000, "median_ms": statistics.median(lat) * 1000}


def _flacs(serve: ServeProcess, headers: dict) -> list[dict]:
    # The runner loaded first: a model's load is not the check's time.
    httpx.post(f"{serve.url}/v1/audio/transcriptions", headers=headers, timeout=600,
               data={"model": AUDIO, "max_tokens": "2"}, files={"file": ("a.wav", audio_files.sweep("wav", 1.0))})
    out = []
    for size in (130_000, 1_000_000):
        data = audio_files.frame_header_flac(size)
        t0 = time.perf_counter()
        try:
            check_audio(data, "flac", "file", AudioLimits().for_projector("qwen2a"))
            verdict = "accepted"
        except ApiError as err:
            verdict = f"refused: {err.message}"
        check_ms = (time.perf_counter() - t0) * 1000
        probe = _Probe(serve.url)
        probe.start()
        time.sleep(0.5)
        t0 = time.perf_counter()
        r = httpx.post(f"{serve.url}/v1/audio/transcriptions", headers=headers, timeout=600,
                       data={"model": AUDIO, "max_tokens": "4"}, files={"file": ("a.flac", data)})
        answer_ms = (time.perf_counter() - t0) * 1000
        time.sleep(0.5)
        probe.stop.set()
        probe.join()
        out.append({"bytes": len(data), "check_ms": check_ms, "check": verdict, "upload_status": r.status_code,
                    "upload_ms": answer_ms, "healthz": probe.summary()})
        h = out[-1]["healthz"]
        print(f"frame-header FLAC {len(data):>9,} B: check {check_ms:6.1f} ms ({verdict[:40]}); upload "
              f"{r.status_code} in {answer_ms:6.1f} ms; /healthz max {h['max_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms "
              f"over {h['probes']} probes, {h['failures']} failed")
    return out


def _short_wavs(serve: ServeProcess, headers: dict, other: dict) -> list[dict]:
    out = []
    httpx.post(f"{serve.url}/v1/audio/transcriptions", headers=headers, timeout=600,
               data={"model": AUDIO, "max_tokens": "2"}, files={"file": ("a.wav", audio_files.sweep("wav", 1.0))})
    for frames in (1, 100, 399):
        pids = {p.pid for p in serve.runner_arbiters()}
        done: dict = {}

        def stream(done: dict = done):
            body = {"model": AUDIO, "stream": True, "max_tokens": 40, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "Count to fifty."}]}
            with httpx.stream("POST", f"{serve.url}/v1/chat/completions", headers=other, json=body, timeout=600) as r:
                lines = list(r.iter_lines())
            done["ok"] = "data: [DONE]" in lines and not any('"error"' in line for line in lines)

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(1.0)
        wav = audio_files.wav_bytes(audio_files.sweep_pcm(1.0)[:frames])
        r = httpx.post(f"{serve.url}/v1/audio/transcriptions", headers=headers, timeout=600,
                       data={"model": AUDIO}, files={"file": ("a.wav", wav)})
        t.join()
        same = pids == {p.pid for p in serve.runner_arbiters()}
        out.append({"frames": frames, "status": r.status_code, "code": (r.json().get("error") or {}).get("code"),
                    "other_stream_completed": done.get("ok"), "runner_unchanged": same})
        print(f"{frames:>3}-sample WAV: upload {r.status_code} {out[-1]['code']}; another member's stream completed: "
              f"{done.get('ok')}; runner unchanged: {same}")
    return out


def _trickle(port: int, every_s: float) -> float:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(every_s)
        for byte in b'{"type": "describe", "data": {"pad": "' + b"x" * 1000 + b'"}}\n':
            try:
                s.send(bytes([byte]))
                if s.recv(4096):
                    break
            except TimeoutError:
                continue
            except OSError:
                break
    return time.monotonic() - t0


def _connections(port: int, n: int) -> dict:
    socks, refused, refusal_ms = [], 0, []
    try:
        for i in range(n):
            addr = f"127.0.{10 + i // 250}.{i % 250 + 1}"
            t0 = time.perf_counter()
            s = socket.create_connection(("127.0.0.1", port), source_address=(addr, 0))
            socks.append(s)
            s.settimeout(0.3)
            try:
                if b'"error"' in s.recv(4096):
                    refused += 1
                    refusal_ms.append((time.perf_counter() - t0) * 1000)
            except TimeoutError:
                pass
    finally:
        for s in socks:
            s.close()
    return {"opened": n, "refused": refused, "first_refused_at": n - refused + 1 if refused else None,
            "max_refusal_ms": max(refusal_ms, default=None)}


def _buffering(serve: ServeProcess, port: int, clients: int, mib: float) -> dict:
    from wyoming.audio import AudioChunk, AudioStart
    from wyoming.event import async_write_event

    rss = [serve.serve_rss_bytes()]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.1):
            try:
                rss.append(serve.serve_rss_bytes())
            except psutil.Error:
                pass

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    codes: list[str] = []

    async def client(i: int):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(f"127.0.20.{i + 1}", 0))
        except OSError as exc:
            codes.append(f"connect: {exc}")
            return
        try:
            await async_write_event(AudioStart(rate=48000, width=2, channels=2).event(), writer)
            chunk = AudioChunk(rate=48000, width=2, channels=2, audio=bytes(32768)).event()
            for _ in range(int(mib * 32)):
                await async_write_event(chunk, writer)
            line = await asyncio.wait_for(reader.read(4096), 10)
            codes.append(json.loads(line.split(b"\n", 2)[1]).get("code", "?") if b"\n" in line else "none")
        except (ConnectionError, TimeoutError, ValueError, IndexError) as exc:
            codes.append(type(exc).__name__)
        finally:
            writer.close()

    async def run():
        await asyncio.gather(*(client(i) for i in range(clients)))

    asyncio.run(run())
    time.sleep(1.0)
    stop.set()
    sampler.join()
    after = serve.serve_rss_bytes()
    counts = {c: codes.count(c) for c in sorted(set(codes))}
    out = {"clients": clients, "mib_each": mib, "rss_before_mib": rss[0] / 2**20, "rss_peak_mib": max(rss) / 2**20,
           "rss_after_mib": after / 2**20, "growth_mib": (max(rss) - rss[0]) / 2**20, "answers": counts}
    print(f"{clients} Wyoming clients each buffering {mib:g} MiB: serve RSS {out['rss_before_mib']:.1f} MiB before, "
          f"{out['rss_peak_mib']:.1f} peak (+{out['growth_mib']:.1f} MiB), {out['rss_after_mib']:.1f} after; "
          f"answers {counts}")
    return out


def run(args, model_path: str) -> int:
    """Run the attacks and print the figures."""
    with tempfile.TemporaryDirectory(prefix="hearth-speech-attack-") as tmp:
        root = Path(tmp)
        data, models = root / "data", root / "models"
        models.mkdir()
        shutil.copyfile(model_path, models / f"{AUDIO}.gguf")
        shutil.copyfile(cached_audio_mmproj(model_path), models / f"mmproj-{AUDIO}-f32.gguf")
        port = free_port()
        tokens = prepare_data(data, settings={"wyoming_port": port, "wyoming_bind": "127.0.0.1",
                                              "wyoming_allow": "127.0.0.0/8", "runner_ctx": 2048},
                              tokens=[("alice", "chat", []), ("bob", "chat", [])])
        serve = ServeProcess(data, models, Path(model_path), root / "serve.log", 180)
        try:
            print(f"hearth serve (default settings, runner_ctx 2048), model {Path(model_path).name} + random qwen2a "
                  f"projector; {platform.processor() or platform.machine()}, {psutil.cpu_count()} CPUs")
            alice = {"Authorization": f"Bearer {tokens['alice']}"}
            bob = {"Authorization": f"Bearer {tokens['bob']}"}
            figures = {"flac": _flacs(serve, alice), "short_wav": _short_wavs(serve, alice, bob)}
            if not args.skip_trickle:
                held = _trickle(port, args.trickle_s)
                figures["trickle_held_s"] = held
                print(f"a client sending a byte every {args.trickle_s:g} s was dropped after {held:.1f} s")
            conns = _connections(port, args.connections)
            figures["connections"] = conns
            print(f"{conns['opened']} Wyoming connections: {conns['refused']} refused (the first at number "
                  f"{conns['first_refused_at']}), each within {conns['max_refusal_ms'] or 0:.1f} ms")
            figures["buffering"] = _buffering(serve, port, args.clients, args.client_mib)
        finally:
            serve.stop()
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=2))
    return 0
