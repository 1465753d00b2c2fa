"""`hearth bench tts` and `hearth bench voice-loop`: speech out through a real `hearth serve` (default settings, the
embedded model, the embedded voice), alone and with background generation running.

- tts: time to first audio of a one-sentence `/v1/audio/speech` (pcm, streamed: the first audio byte the client
  receives), p50/p95 over --reps, alone and while --background background-class streams decode; with the background
  streams' time per output token with and without speech beside them (what synthesis costs the LLM's decode).
- voice-loop: a generated WAV (a spoken request, as a satellite sends it once the person stops talking) through the
  transcriptions route; the transcript (with --question, since the random projector's transcript is noise) streamed
  through the LLM in the voice class; each complete sentence fed to /v1/audio/speech as soon as it is complete.
  Printed per stage: end of speech → transcript → first LLM token → first complete sentence → first audio, and end
  of speech → first audio (the figure a person hears), p50/p95.
"""

from __future__ import annotations

import json
import platform
import shutil
import statistics
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil

from app.devtools import audio_files
from app.devtools.serve_process import ServeProcess, prepare_data
from app.paths import data_dir
from app.speech.sentences import SentenceBuffer
from app.speech.voices import embedded_voice

SENTENCE = "The front door is locked and the lights are off."
AUDIO = "voice-loop-audio"
BACKGROUND_PROMPT = "Write a long, detailed story about a family that builds a house in the mountains."


def add_tts_arguments(parser) -> None:
    """`hearth bench tts`'s options."""
    parser.add_argument("--model", default=None, help="text model GGUF (default: the embedded model)")
    parser.add_argument("--reps", type=int, default=20, help="requests per phase (default %(default)s)")
    parser.add_argument("--background", type=int, default=2, help="background streams in the loaded phase")
    parser.add_argument("--tts-threads", type=int, default=None, help="the setting tts_threads (default: serve's)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the figures and raw timings here")


def add_loop_arguments(parser) -> None:
    """`hearth bench voice-loop`'s options."""
    parser.add_argument("--model", default=None, help="text model GGUF (default: the embedded model)")
    parser.add_argument("--reps", type=int, default=8, help="spoken requests per phase (default %(default)s)")
    parser.add_argument("--background", type=int, default=2, help="background streams in the loaded phase")
    parser.add_argument("--question", default="Say in two short sentences what a kitchen is for.",
                        help="what the LLM is asked, with the transcript appended")
    parser.add_argument("--json", dest="json_path", default=None, help="write the figures and raw timings here")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def _summary(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": _pct(values, 0.5) * 1000, "p95_ms": _pct(values, 0.95) * 1000,
            "max_ms": max(values, default=float("nan")) * 1000}


class Background(threading.Thread):
    """`n` background-class streams, each started again as it ends, until stopped; every gap between two of a
    stream's tokens kept with its time (the decode's pace, window by window)."""

    def __init__(self, url: str, headers: dict, n: int):
        super().__init__(daemon=True)
        self.url, self.headers, self.n = url, headers, n
        self.stop_event = threading.Event()
        self.gaps: list[tuple[float, float]] = []  # (time of the token, seconds since the stream's previous one)
        self.streams = 0

    def _one(self) -> None:
        with httpx.Client(timeout=600) as c:
            while not self.stop_event.is_set():
                last = None
                body = {"messages": [{"role": "user", "content": BACKGROUND_PROMPT}], "max_tokens": 200,
                        "stream": True, "hearth_class": "background"}
                with c.stream("POST", f"{self.url}/v1/chat/completions", json=body, headers=self.headers) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and '"content"' in line:
                            now = time.perf_counter()
                            if last is not None:
                                self.gaps.append((now, now - last))
                            last = now
                self.streams += 1

    def run(self) -> None:
        """Run the streams until stopped."""
        workers = [threading.Thread(target=self._one, daemon=True) for _ in range(self.n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def wait_decoding(self) -> None:
        """Until the runner is up and the streams decode."""
        while len(self.gaps) < 10 * self.n:
            time.sleep(0.1)

    def gaps_ms(self, start: float, end: float) -> list[float]:
        """The token gaps seen between start and end, in ms."""
        return [g * 1000 for t, g in self.gaps if start <= t < end]


def first_audio_s(client: httpx.Client, headers: dict, text: str, t0: float | None = None) -> tuple[float, float]:
    """(time to the first audio byte, time to the last) of one streamed pcm speech request, from t0 (default now)."""
    t0 = t0 or time.perf_counter()
    first = None
    with client.stream("POST", "/v1/audio/speech", headers=headers,
                       json={"model": "tts-1", "input": text, "response_format": "pcm", "hearth_class": "voice"}) as r:
        r.raise_for_status()
        for chunk in r.iter_bytes():
            if chunk and first is None:
                first = time.perf_counter()
    return first - t0, time.perf_counter() - t0


def _start(root: Path, model_path: str, audio: bool = False, tts_threads: int | None = None) -> tuple[ServeProcess, dict]:
    data, models = root / "data", root / "models"
    models.mkdir()
    if audio:
        from app.devtools.audio_mmproj import cached_audio_mmproj

        shutil.copyfile(model_path, models / f"{AUDIO}.gguf")
        shutil.copyfile(cached_audio_mmproj(model_path), models / f"mmproj-{AUDIO}-f32.gguf")
    settings = {"runner_ctx": 2048} if audio else {}
    if tts_threads:
        settings["tts_threads"] = tts_threads
    tokens = prepare_data(data, tokens=[("alice", "voice", ["background", "chat"]), ("bg", "background", [])],
                          settings=settings)
    serve = ServeProcess(data, models, Path(model_path), root / "serve.log", 180)
    return serve, {m: {"Authorization": f"Bearer {t}"} for m, t in tokens.items()}


def _machine(model_path: str) -> str:
    voice = embedded_voice()
    return (f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} CPUs, load average "
            f"{', '.join(f'{x:.2f}' for x in psutil.getloadavg())}; model {Path(model_path).name}; voice "
            f"{voice.name if voice else '?'}; hearth serve default settings")


def _tts_phase(serve: ServeProcess, headers: dict, reps: int) -> list[float]:
    with httpx.Client(base_url=serve.url, timeout=600) as c:
        first_audio_s(c, headers, "Warm up.")  # the process started and the voice loaded: not a request's time
        return [first_audio_s(c, headers, SENTENCE)[0] for _ in range(reps)]


def run_tts(args, model_path: str) -> int:
    """Time to first audio of one sentence, alone and under background decoding."""
    with tempfile.TemporaryDirectory(prefix="hearth-bench-tts-") as tmp:
        serve, headers = _start(Path(tmp), model_path, tts_threads=args.tts_threads)
        try:
            print(_machine(model_path) + f"; tts_threads {args.tts_threads or 'default (half the cores)'}")
            alone = _tts_phase(serve, headers["alice"], args.reps)
            bg = Background(serve.url, headers["bg"], args.background)
            bg.start()
            bg.wait_decoding()
            quiet_from = time.perf_counter()
            time.sleep(5.0)
            speech_from = time.perf_counter()
            loaded = _tts_phase(serve, headers["alice"], args.reps)
            speech_to = time.perf_counter()
            bg.stop_event.set()
            tpot_quiet, tpot_speech = bg.gaps_ms(quiet_from, speech_from), bg.gaps_ms(speech_from, speech_to)
        finally:
            serve.stop()
    figures = {"alone": _summary(alone), "background": _summary(loaded), "raw_alone_s": alone,
               "raw_background_s": loaded, "background_streams": args.background,
               "background_token_gaps_ms_without_speech": tpot_quiet,
               "background_token_gaps_ms_with_speech": tpot_speech}
    for name, values in (("alone", alone), (f"{args.background} background streams", loaded)):
        s = _summary(values)
        print(f"time to first audio, one sentence ({len(SENTENCE)} chars), {name}: p50 {s['p50_ms']:.0f} ms, "
              f"p95 {s['p95_ms']:.0f} ms, max {s['max_ms']:.0f} ms over {s['n']}")
    for name, values in (("without speech", tpot_quiet), ("while speaking", tpot_speech)):
        if values:
            print(f"background streams' gap between tokens {name}: median {statistics.median(values):.1f} ms, "
                  f"p95 {_pct(values, 0.95):.1f} ms over {len(values)} tokens")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=2))
    return 0


def _answer(c: httpx.Client, headers: dict, prompt: str, marks: dict, ready: threading.Event, out: list) -> None:
    """Stream the LLM's answer in the voice class to its end; mark its first token, and hand out its first complete
    sentence (`out`, `ready`) the moment it is complete, while the rest is still being decoded."""
    sentences = SentenceBuffer()
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 60, "stream": True,
            "hearth_class": "voice", "temperature": 0}
    try:
        with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                delta = (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content") \
                    if line.startswith("data: {") else None
                if not delta:
                    continue
                marks.setdefault("first_token", time.perf_counter())
                done = sentences.add(delta)
                if done and not ready.is_set():
                    marks["first_sentence"] = time.perf_counter()
                    out.append(done[0])
                    ready.set()
    finally:
        if not ready.is_set():
            marks.setdefault("first_token", time.perf_counter())
            marks["first_sentence"] = time.perf_counter()
            out.append(sentences.finish() or "I have no answer.")
            ready.set()


def _loop_once(c: httpx.Client, headers: dict, wav: bytes, question: str) -> dict:
    """One spoken request through the loop; each stage's seconds."""
    marks = {"end_of_speech": time.perf_counter()}
    r = c.post("/v1/audio/transcriptions", headers=headers, data={"model": AUDIO, "max_tokens": "16",
                                                                  "hearth_class": "voice"},
               files={"file": ("request.wav", wav)})
    r.raise_for_status()
    marks["transcript"] = time.perf_counter()
    ready, out = threading.Event(), []
    with httpx.Client(base_url=str(c.base_url), timeout=600) as llm:
        answer = threading.Thread(target=_answer, args=(llm, headers, f"{question} ({r.json().get('text', '')[:80]})",
                                                        marks, ready, out), daemon=True)
        answer.start()
        ready.wait()
        marks["first_audio"] = marks["first_sentence"] + first_audio_s(c, headers, out[0], marks["first_sentence"])[0]
        answer.join()
    return {"speech_to_transcript": marks["transcript"] - marks["end_of_speech"],
            "transcript_to_first_token": marks["first_token"] - marks["transcript"],
            "first_token_to_first_sentence": marks["first_sentence"] - marks["first_token"],
            "first_sentence_to_first_audio": marks["first_audio"] - marks["first_sentence"],
            "speech_to_first_audio": marks["first_audio"] - marks["end_of_speech"]}


def _loop_phase(serve: ServeProcess, headers: dict, reps: int, question: str) -> list[dict]:
    wav = audio_files.sweep("wav", seconds=2.0)
    with httpx.Client(base_url=serve.url, timeout=600) as c:
        _loop_once(c, headers, wav, question)  # runner and voice loaded: not a request's time
        return [_loop_once(c, headers, wav, question) for _ in range(reps)]


def _print_loop(name: str, runs: list[dict]) -> dict:
    out = {}
    print(f"voice loop, {name} ({len(runs)} spoken requests):")
    for stage in runs[0]:
        s = out[stage] = _summary([r[stage] for r in runs])
        print(f"  {stage.replace('_', ' '):34s} p50 {s['p50_ms']:7.0f} ms   p95 {s['p95_ms']:7.0f} ms")
    return out


def run_voice_loop(args, model_path: str) -> int:
    """The voice loop's stages, alone and under background decoding."""
    with tempfile.TemporaryDirectory(prefix="hearth-bench-voice-loop-") as tmp:
        serve, headers = _start(Path(tmp), model_path, audio=True)
        try:
            print(_machine(model_path) + "; a random Whisper-style projector beside it (the transcript is noise)")
            alone = _loop_phase(serve, headers["alice"], args.reps, args.question)
            bg = Background(serve.url, headers["bg"], args.background)
            bg.start()
            bg.wait_decoding()
            loaded = _loop_phase(serve, headers["alice"], args.reps, args.question)
            bg.stop_event.set()
        finally:
            serve.stop()
    figures = {"alone": _print_loop("alone", alone),
               "background": _print_loop(f"with {args.background} background streams", loaded),
               "raw_alone_s": alone, "raw_background_s": loaded, "machine": _machine(model_path),
               "at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=2))
    # The Bench page's chart reads the last run from the data folder.
    last = data_dir() / "bench" / "voice-loop.json"
    last.parent.mkdir(parents=True, exist_ok=True)
    last.write_text(json.dumps(figures, indent=2))
    print(f"written for the Bench page: {last}")
    return 0
