"""`hearth bench audio`: audio in Hearth against stock llama-server, the oracle.

The same model (the embedded Gemma 3 270M unless --model), the same random Whisper-style projector
(app/devtools/audio_mmproj.py), the same generated audio (a sine sweep as WAV, MP3 and FLAC), greedy: for every
format and route (chat with an input_audio part, /v1/audio/transcriptions), whole and streamed, a hearth runner
and stock llama-server must give the same prompt token count and the same text. Each comparison runs on a fresh
pair of servers: llama-server's transcription route cannot turn its prompt cache off, and a prefix taken from a
cache is computed in other batches than a fresh one, which tips the random model's greedy near-ties on either
server.
"""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import httpx

from app.devtools.parity import audio_load
from app.devtools.processes import stop_process

ASK = "Transcribe the audio."
ROUTES = ("chat", "transcriptions")


def add_arguments(parser) -> None:
    """The bench's options."""
    parser.add_argument("--model", default=None, help="text model GGUF (default: the embedded model)")
    parser.add_argument("--shape", default="mmproj-qwen2a-tiny", help="audio projector shape (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=2.5, help="length of the generated sweep (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--formats", default="wav,mp3,flac")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    audio_load.add_arguments(parser)


class _Pair:
    """A fresh hearth runner (in this process, on loopback HTTP) and a fresh stock llama-server."""

    def __init__(self, model: str, projector: Path, folder: Path):
        from werkzeug.serving import make_server

        from app.devtools.gguf_shapes import CHATML_TEMPLATE
        from app.engine.model_config import ModelConfig
        from app.runner.app import create_app
        from app.runner.config import RunnerConfig

        self.proc, self.stock = audio_load.start_stock(model, projector, folder,
                                                       ["-t", "2", "-c", "2048", "-np", "1", "--swa-full"])
        self.app = create_app(RunnerConfig(ModelConfig(path=model, n_ctx=2048, n_seq_max=1, n_threads=2),
                                           mmproj=str(projector), chat_template=CHATML_TEMPLATE))
        self.server = make_server("127.0.0.1", 0, self.app, threaded=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.ours = httpx.Client(base_url=f"http://127.0.0.1:{self.server.server_port}", timeout=300)
        audio_load.wait_healthy(self.ours, None, None)

    def close(self) -> None:
        self.ours.close()
        self.stock.close()
        self.server.shutdown()
        self.app.state.engine.stop()
        self.app.state.model.close()
        stop_process(self.proc, 15)


def _events(resp: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


def ask(client: httpx.Client, route: str, data: bytes, fmt: str, stream: bool, max_tokens: int) -> tuple[int, str]:
    """(prompt tokens, text) of one greedy request on route, whole or streamed."""
    if route == "chat":
        body = {"temperature": 0, "max_tokens": max_tokens, "cache_prompt": False, "stream": stream,
                "messages": [{"role": "user", "content": [{"type": "text", "text": ASK}, {
                    "type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}]}]}
        if not stream:
            r = client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            a = r.json()
            return a["usage"]["prompt_tokens"], a["choices"][0]["message"]["content"]
        body["stream_options"] = {"include_usage": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            events = _events(r)
        text = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices") or [])
        return next(e["usage"]["prompt_tokens"] for e in events if e.get("usage")), text
    form = {"model": "m", "temperature": "0", "max_tokens": str(max_tokens), "stream": "true" if stream else "false"}
    files = {"file": (f"clip.{fmt}", data)}
    if not stream:
        r = client.post("/v1/audio/transcriptions", data=form, files=files)
        r.raise_for_status()
        a = r.json()
        return a["usage"]["input_tokens"], a["text"]
    with client.stream("POST", "/v1/audio/transcriptions", data=form, files=files) as r:
        r.raise_for_status()
        events = _events(r)
    text = "".join(e.get("delta", "") for e in events if e.get("type") == "transcript.text.delta")
    done = [e for e in events if e.get("type") == "transcript.text.done"]
    # llama-server's stream closes without a usage event: its count is read from its whole answer's equal.
    return (done[0]["usage"]["input_tokens"] if done else -1), text


def run(args) -> int:
    """Compare every format, route and mode on a fresh pair; print a table; non-zero when one differs."""
    import tempfile

    from app.devtools import audio_files
    from app.devtools.audio_mmproj import cached_audio_mmproj
    from app.runner.command import resolve_model

    if audio_files.encoders_missing():
        raise SystemExit(f"hearth bench audio: apt-get install {' '.join(audio_files.encoders_missing())}")
    model = resolve_model(args.model)
    projector = cached_audio_mmproj(model, args.shape)
    if args.under_load:
        return audio_load.run(args, model, projector)
    rows = []
    print(f"{'format':6} {'route':15} {'mode':8} {'prompt ours':>11} {'stock':>6}  same text")
    for fmt in args.formats.split(","):
        data = audio_files.sweep(fmt, seconds=args.seconds)
        for route in ROUTES:
            for stream in (False, True):
                with tempfile.TemporaryDirectory() as d:
                    pair = _Pair(model, projector, Path(d))
                    try:
                        ours = ask(pair.ours, route, data, fmt, stream, args.max_tokens)
                        theirs = ask(pair.stock, route, data, fmt, stream, args.max_tokens)
                    finally:
                        pair.close()
                same = ours[1] == theirs[1] and (ours[0] == theirs[0] or theirs[0] == -1)
                rows.append({"format": fmt, "route": route, "stream": stream, "prompt_tokens_ours": ours[0],
                             "prompt_tokens_stock": theirs[0], "text_ours": ours[1], "text_stock": theirs[1],
                             "same": same})
                print(f"{fmt:6} {route:15} {'stream' if stream else 'whole':8} {ours[0]:>11} {theirs[0]:>6}  "
                      f"{'yes' if same else 'NO: ' + repr(ours[1]) + ' vs ' + repr(theirs[1])}")
    ok = all(r["same"] for r in rows)
    print(f"{sum(r['same'] for r in rows)} of {len(rows)} identical")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "projector": str(projector), "rows": rows}, indent=1))
    return 0 if ok else 1
