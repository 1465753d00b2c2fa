"""`hearth bench audio --under-load`: a voice request's time to first token when its audio must be encoded while
background prompts run, through `hearth serve` (default settings, the voice and background classes) against stock
llama-server with the same model, projector, context, slots and threads (read from serve's own runner).

Each round sends the background prompts (long, streamed), waits --voice-after seconds so they are in their
prefill, then sends one streamed transcription of a fresh sweep (another frequency every round, so no cache holds
its audio) and times its first transcript delta by the client's stopwatch. The figure is the median over rounds.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from app.devtools.processes import stop_process
from app.devtools.stock_server import stock_command

NAME = "hearth-audio"


def add_arguments(parser) -> None:
    """The under-load options of `hearth bench audio`."""
    parser.add_argument("--under-load", action="store_true",
                        help="instead of the oracle: a voice transcription's TTFT while background prompts run, "
                             "through hearth serve against stock llama-server")
    parser.add_argument("--background", type=int, default=4, help="--under-load: background prompts (default 4)")
    parser.add_argument("--background-tokens", type=int, default=1500,
                        help="--under-load: prompt tokens of each background prompt (about; default 1500)")
    parser.add_argument("--voice-after", type=float, default=0.5,
                        help="--under-load: seconds between the background prompts and the voice request")
    parser.add_argument("--rounds", type=int, default=3, help="--under-load: rounds per target (default 3)")


def _background_prompt(i: int, round_: int, tokens: int) -> str:
    # About 16 tokens a sentence with Gemma's tokenizer; a round and member of its own, so no prefix is cached.
    return " ".join(f"r{round_} note {i}: box {j % 97} sits on shelf {j % 13}." for j in range(tokens // 16))


def _stream_chat(url: str, headers: dict, prompt: str, done: list) -> None:
    body = {"model": NAME, "messages": [{"role": "user", "content": prompt + "\nSummarise."}], "max_tokens": 32,
            "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
            text = "".join(r.iter_lines())
            done.append(r.status_code if r.status_code == 200 else f"{r.status_code}: {text[:300]}")
    except httpx.HTTPError as error:
        done.append(repr(error))


def _voice_ttft(url: str, headers: dict, model: str, wav: bytes) -> float:
    """Client stopwatch (ms) from sending a streamed transcription to its first transcript delta."""
    form = {"model": model, "temperature": "0", "max_tokens": "8", "stream": "true"}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/audio/transcriptions", data=form, files={"file": ("voice.wav", wav)},
                      headers=headers, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"hearth bench audio: the voice request got HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and "transcript.text.delta" in line:
                return (time.perf_counter() - t0) * 1000
    raise SystemExit("hearth bench audio: the voice request streamed no transcript delta")


def _rounds(url: str, bg_headers: dict, voice_headers: dict, model: str, args) -> list[float]:
    from app.devtools import audio_files

    out = []
    for n in range(args.rounds):
        done: list = []
        threads = [threading.Thread(target=_stream_chat, args=(url, bg_headers,
                                                               _background_prompt(i, n, args.background_tokens), done))
                   for i in range(args.background)]
        for t in threads:
            t.start()
        time.sleep(args.voice_after)
        wav = audio_files.wav_bytes(audio_files.sweep_pcm(args.seconds, f0=180.0 + 23 * n, f1=1900.0 - 31 * n))
        out.append(_voice_ttft(url, voice_headers, model, wav))
        for t in threads:
            t.join()
        if any(d != 200 for d in done):
            raise SystemExit(f"hearth bench audio: a background prompt failed: {done}")
    return out


def wait_healthy(client: httpx.Client, proc: subprocess.Popen | None, log: Path | None) -> None:
    """Until the server answers /health with 200; a SystemExit with its log's tail if it exits, or after 180 s."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"hearth bench audio: llama-server exited: {log.read_text()[-2000:] if log else ''}")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("hearth bench audio: a server did not become healthy in 180 s")


def start_stock(model: str, projector: Path, folder: Path, flags: list[str]) -> tuple[subprocess.Popen, httpx.Client]:
    """Stock llama-server on model + projector with the ChatML template and `flags`, healthy; its log in folder."""
    from app.devtools.gguf_shapes import CHATML_TEMPLATE
    from app.llama_tools import stock_llama_server
    from app.residency.supervisor import free_port

    binary = stock_llama_server()
    if binary is None:
        raise SystemExit("hearth bench audio: stock llama-server is not built (scripts/build_llama_tools.sh)")
    template = folder / "chatml.jinja"
    template.write_text(CHATML_TEMPLATE)
    log = folder / "llama-server.log"
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(stock_command(binary, model, "--mmproj", str(projector), *flags, "--jinja",
                                              "--chat-template-file", str(template), port=port, same_cache=False),
                                stdout=out, stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
    try:
        wait_healthy(client, proc, log)
    except BaseException:
        client.close()
        stop_process(proc)
        raise
    return proc, client


def _runner_shape(serve) -> dict[str, str]:
    """--ctx, --parallel and --threads of serve's runner, as its command line says."""
    for p in serve.runner_arbiters():
        args = p.cmdline()
        return {flag: args[args.index(flag) + 1] for flag in ("--ctx", "--parallel", "--threads") if flag in args}
    raise SystemExit("hearth bench audio: serve has no runner")


def run(args, model: str, projector: Path) -> int:
    """Serve first (its runner's shape decides llama-server's flags), then llama-server; print both and the ratio.
    A runner's --ctx is KV cells shared by its slots: llama-server gets -kvu for the same."""
    from app.devtools import audio_files
    from app.devtools.serve_process import ServeProcess, prepare_data

    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="hearth-audio-load-") as tmp:
        root = Path(tmp)
        data, models = root / "data", root / "models"
        models.mkdir()
        shutil.copyfile(model, models / f"{NAME}.gguf")
        shutil.copyfile(projector, models / f"mmproj-{NAME}-f32.gguf")
        tokens = prepare_data(data, tokens=[("voice", "voice", []), ("bg", "background", [])])
        serve = ServeProcess(data, models, models / f"{NAME}.gguf", root / "serve.log")
        try:
            voice_h = {"Authorization": f"Bearer {tokens['voice']}"}
            warm = audio_files.sweep("wav", seconds=1.0)
            _voice_ttft(serve.url, voice_h, NAME, warm)  # loads the model and its projector
            shape = _runner_shape(serve)
            results["hearth serve"] = _rounds(serve.url, {"Authorization": f"Bearer {tokens['bg']}"}, voice_h,
                                              NAME, args)
        finally:
            serve.stop()
        proc, stock = start_stock(model, projector, root, ["-c", shape["--ctx"], "-np", shape["--parallel"],
                                                           "-t", shape["--threads"], "-kvu"])
        url = str(stock.base_url).rstrip("/")
        try:
            _voice_ttft(url, {}, NAME, warm)
            results["llama-server"] = _rounds(url, {}, {}, NAME, args)
        finally:
            stock.close()
            stop_process(proc)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"voice transcription of {args.seconds} s of audio while {args.background} background prompts of "
          f"~{args.background_tokens} tokens run (sent {args.voice_after} s after them); runner shape "
          f"{' '.join(f'{k} {v}' for k, v in shape.items())}; {args.rounds} rounds, median")
    for k, v in results.items():
        print(f"  {k:13} TTFT {med[k]:8.0f} ms   (rounds: {', '.join(f'{x:.0f}' for x in v)})")
    ratio = med["hearth serve"] / med["llama-server"]
    print(f"  serve / llama-server: {ratio:.3f}× (target ≤ 0.1×)")
    if args.json:
        Path(args.json).write_text(json.dumps({"ttft_ms": results, "median_ms": med, "ratio": ratio,
                                               "shape": shape}, indent=1))
    return 0
