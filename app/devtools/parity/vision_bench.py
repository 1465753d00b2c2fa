"""`hearth bench vision`: images against stock llama-server, and the pause an image causes a decoding stream.

Oracle (when the stock llama-server binary is built): the same model, random projector (`hearth models random
mmproj-…`), ChatML template file and image, greedy, through `hearth runner` (in-process) and stock llama-server;
per format (PNG, JPEG, WebP; llama-server gets WebP as the PNG of its pixels, since it refuses WebP) the prompt
token counts and whether the generated text is the same.

Serve oracle (`--serve`, the product's figure): one `hearth serve` with default settings on a fresh data folder
whose models folder holds a copy of the model and its random projector, and stock llama-server started as serve
would start a llama-server runner of it, with the hearth runner's context, slots, batch, threads, projector and
chat template; per format and image, llama-server's OpenAI chat answer against each of serve's image routes
(OpenAI chat, Ollama chat and generate, Anthropic messages, Responses): the total prompt tokens, the generated
tokens and whether the text is the same. The image goes before the text in every request, where Ollama's prompt
puts its `images`. Then the generated token ids: serve's runner's /completion of the prompt its /apply-template
renders, with the image as multimodal_data, against llama-server's /completion of the same text. Differences that
are the servers' own, not Hearth's, and how they are met: llama-server has no WebP decoder (it gets the PNG of the
same pixels, which is what Hearth hands libmtmd too); its media marker is random per process (read from its
/props); the embedded GGUF has no chat template, so llama-server is given the one serve's runner uses; Hearth's
sliding-window cache is full-size (--swa-full). After the first API, serve's prefix cache holds the image's
prompt, so the later APIs compute only its last token, and still answer the same.

Pause (a lab figure of one runner driven directly): one voice-class stream (TPOT target 100 ms) decodes; after
`--warm-tokens` of its tokens a second request arrives, in three arms interleaved over `--rounds`:
  image   a chat request with one image (encoded in the MediaStep's worker thread, the default),
  inline  the same, encoded on the engine thread (every sequence waits meanwhile: the baseline),
  text    a text prompt of the same token count (the pause a prefill of that size causes).
Per arm: the stream's longest gap between two tokens while the second request was in flight, its median gap
before, and the image's encode and KV-decode times as the MediaStep measured them. Raw gaps go to --json.
One image is sent before the rounds and left out of them: the first pages the projector's weights in.

Follow-up: a second turn about the same image (tiny projector): its prompt tokens computed against the new
turn's own tokens (the target: computed ≤ the new turn). Memory: the RSS of real `hearth runner` workers
without and with --mmproj (after the load, after one image), beside the projector's file size.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import threading
import time
from pathlib import Path

from werkzeug.test import Client

from app.devtools.gguf_shapes import CHATML_TEMPLATE
from app.devtools.mmproj import MMPROJ_SHAPES, cached_mmproj
from app.devtools.stock_server import stock_command
from app.engine.model_config import ModelConfig
from app.engine.request import Delta, Finished, SamplingParams
from app.hardware import machine
from app.llama_tools import stock_llama_server
from app.policy import SloTargets
from app.residency.supervisor import free_port
from app.runner.app import create_app
from app.runner.config import RunnerConfig

VOICE = SloTargets(ttft_ms=500, tpot_ms=100, preemptible=False)
QUESTION = "Describe this picture in one sentence."
ARMS = ("image", "inline", "text")


def _png(seed: int, size: tuple[int, int]) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _encoded(data: bytes, fmt: str) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    with Image.open(io.BytesIO(data)) as im:
        im.save(out, format=fmt)
    return out.getvalue()


def _data_url(data: bytes, mime: str) -> str:
    import base64

    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _message(url: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": QUESTION},
                                        {"type": "image_url", "image_url": {"url": url}}]}


def _runner(model: str, projector: Path, threads: int, ctx: int):
    config = RunnerConfig(ModelConfig(path=model, n_ctx=ctx, n_seq_max=2, n_threads=threads),
                          mmproj=str(projector), chat_template=CHATML_TEMPLATE)
    app = create_app(config)
    deadline = time.monotonic() + 300
    while app.state.status == "loading" and time.monotonic() < deadline:
        time.sleep(0.05)
    if app.state.status != "ok":
        raise SystemExit(f"hearth bench vision: the runner did not load: {app.state.error}")
    return app


def _close(app) -> None:
    app.state.engine.stop()
    app.state.model.close()


def oracle(model: str, projector: Path, threads: int, ctx: int, binary: Path, images: int, max_tokens: int) -> dict:
    """Per format: (hearth prompt tokens, stock prompt tokens, same text) for each image."""
    import subprocess
    import tempfile

    import httpx

    from app.runner.images import as_png

    app = _runner(model, projector, threads, ctx)
    ours = Client(app)
    tmp = Path(tempfile.mkdtemp(prefix="hearth-vision-"))
    (tmp / "chatml.jinja").write_text(CHATML_TEMPLATE)
    port = free_port()
    with open(tmp / "llama-server.log", "wb") as log:
        # Hearth's cache layout (same_cache): without a full-size sliding-window cache Gemma 3's SWA layers attend
        # over another cache size, and greedy near-ties tip.
        proc = subprocess.Popen(stock_command(binary, model, "--mmproj", str(projector), "-t", str(threads),
                                              "-c", str(ctx), "-np", "1", "--jinja", "--chat-template-file",
                                              str(tmp / "chatml.jinja"), port=port), stdout=log, stderr=subprocess.STDOUT)
    theirs = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
    rows: dict[str, list[dict]] = {}
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if theirs.get("/health").json().get("status") == "ok":
                    break
            except (httpx.TransportError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit("hearth bench vision: stock llama-server did not become healthy")
            time.sleep(0.2)
        # No prompt cache on either side: each prompt is computed in the same chunks by both.
        body = {"temperature": 0, "max_tokens": max_tokens, "cache_prompt": False}
        for fmt, mime in (("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")):
            for seed in range(images):
                image = _encoded(_png(seed, (96, 64)), fmt)
                a = ours.post("/v1/chat/completions", json={**body, "messages": [_message(_data_url(image, mime))]})
                stock_image, stock_mime = (as_png(image), "image/png") if fmt == "WEBP" else (image, mime)
                b = theirs.post("/v1/chat/completions",
                                json={**body, "messages": [_message(_data_url(stock_image, stock_mime))]}).json()
                a = a.get_json()
                rows.setdefault(fmt, []).append({
                    "seed": seed, "hearth_prompt_tokens": a["usage"]["prompt_tokens"],
                    "stock_prompt_tokens": b["usage"]["prompt_tokens"],
                    "hearth_completion_tokens": a["usage"]["completion_tokens"],
                    "stock_completion_tokens": b["usage"]["completion_tokens"],
                    "same_text": a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"],
                    "hearth_text": a["choices"][0]["message"]["content"],
                    "stock_text": b["choices"][0]["message"]["content"]})
    finally:
        theirs.close()
        proc.terminate()
        proc.wait(15)
        _close(app)
    return rows


# The APIs of the serve oracle, as (name, path): the four of issue 31, Ollama's by both of its routes.
SERVE_APIS = (("openai", "/v1/chat/completions"), ("ollama-chat", "/api/chat"), ("ollama-generate", "/api/generate"),
              ("anthropic", "/v1/messages"), ("responses", "/v1/responses"))
# The name of the vision model in the serve oracle's models folder (its projector: mmproj-<name>-f32.gguf).
SERVE_MODEL = "gemma-vision-Q4_K_M"


def api_body(api: str, model: str, text: str, image: bytes, mime: str, max_tokens: int) -> dict:
    """One user turn of an image then a text, greedy, in an API's own shape.

    The image comes first in every API: Ollama's `images` have no place of their own, and its prompt puts them
    before the message's text (app/protocols/ollama.py), so the others are sent in that order too."""
    import base64

    b64 = base64.b64encode(image).decode()
    url = _data_url(image, mime)
    if api == "openai":
        return {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]}
    if api in ("ollama-chat", "ollama-generate"):
        body = {"model": model, "stream": False, "options": {"temperature": 0, "num_predict": max_tokens}}
        if api == "ollama-generate":
            return {**body, "prompt": text, "images": [b64]}
        return {**body, "messages": [{"role": "user", "content": text, "images": [b64]}]}
    if api == "anthropic":
        return {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": mime, "data": b64}},
            {"type": "text", "text": text}]}]}
    if api == "responses":
        return {"model": model, "max_output_tokens": max_tokens, "temperature": 0, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url}, {"type": "input_text", "text": text}]}]}
    raise ValueError(f"unknown API {api!r}")


def api_answer(api: str, body: dict) -> tuple[str, int, int]:
    """(generated text, TOTAL prompt tokens, generated tokens) of an API's whole answer.

    Cached prompt tokens count in the total: Anthropic's input_tokens leave out what was read from the cache
    (cache_read_input_tokens) and what was written to it; OpenAI's prompt_tokens, Ollama's prompt_eval_count and
    Responses' input_tokens hold them."""
    if api == "openai":
        u = body["usage"]
        return body["choices"][0]["message"]["content"], u["prompt_tokens"], u["completion_tokens"]
    if api == "ollama-chat":
        return body["message"]["content"], body["prompt_eval_count"], body["eval_count"]
    if api == "ollama-generate":
        return body["response"], body["prompt_eval_count"], body["eval_count"]
    if api == "anthropic":
        u = body["usage"]
        text = "".join(b["text"] for b in body["content"] if b["type"] == "text")
        prompt = u["input_tokens"] + u.get("cache_read_input_tokens", 0) + u.get("cache_creation_input_tokens", 0)
        return text, prompt, u["output_tokens"]
    if api == "responses":
        u = body["usage"]
        text = "".join(c["text"] for item in body["output"] if item["type"] == "message"
                       for c in item["content"] if c["type"] == "output_text")
        return text, u["input_tokens"], u["output_tokens"]
    raise ValueError(f"unknown API {api!r}")


def _flag(args: list[str], name: str) -> str:
    """The value of `name` on a command line (`--name V`)."""
    try:
        return args[args.index(name) + 1]
    except (ValueError, IndexError):
        raise SystemExit(f"hearth bench vision: serve's runner has no {name} on its command line: "
                         f"{' '.join(args)}") from None


def _wait_stock(client, proc, log_path: Path, timeout_s: float = 300) -> None:
    """Until stock llama-server answers /health with status ok (it answers 503 while it loads)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"hearth bench vision: stock llama-server exited:\n{log_path.read_text()[-3000:]}")
        try:
            if client.get("/health").json().get("status") == "ok":
                return
        except (httpx.TransportError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"hearth bench vision: stock llama-server did not become healthy in {timeout_s:.0f} s")
        time.sleep(0.2)


def stock_beside(serve, model_name: str, binary: Path, folder: Path):
    """Stock llama-server started as serve would start a llama-server runner of model_name (RunnerSpec's
    llama-server command line), with the context, slots, batch, threads, GPU layers and projector of serve's
    running hearth runner of it, and the chat template that runner's /props reports (the embedded GGUF has
    none: Hearth uses its built-in Gemma 3 template, stock llama-server would fall back to ChatML); plus
    --swa-full, since Hearth's sliding-window cache is full-size. Returns (process, client, what was held)
    once it is healthy; the caller stops the process."""
    import subprocess

    import httpx

    from app.engine.chat import GEMMA3_TEMPLATE
    from app.residency.runner_spec import RunnerSpec

    runner = next((cmd.split() for _, cmd in serve.runner_commands() if f"{model_name}.gguf" in cmd), None)
    if runner is None:
        raise SystemExit(f"hearth bench vision: serve runs no runner of {model_name}")
    props = httpx.get(f"{serve.runner_url()}/props", headers=serve.runner_headers(), timeout=30).json()
    spec = RunnerSpec(model_name=model_name, model_path=_flag(runner, "--model"), kind="llama-server",
                      binary_path=str(binary), n_ctx=int(_flag(runner, "--ctx")),
                      parallel=int(_flag(runner, "--parallel")), n_batch=int(_flag(runner, "--batch")),
                      threads=int(_flag(runner, "--threads")), gpu_layers=int(_flag(runner, "--gpu-layers")),
                      mmproj=_flag(runner, "--mmproj"))
    template = folder / "template.jinja"
    template.write_text(props["chat_template"])
    port = free_port()
    command = spec.command(port) + ["--jinja", "--chat-template-file", str(template), "--swa-full"]
    held = {"n_ctx": spec.n_ctx, "slots": spec.parallel, "n_batch": spec.n_batch, "threads": spec.threads,
            "gpu_layers": spec.gpu_layers, "runner_command": runner, "stock_command": command,
            "template_is_builtin_gemma3": props["chat_template"] == GEMMA3_TEMPLATE}
    log_path = folder / "llama-server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
    try:
        _wait_stock(client, proc, log_path)
    except BaseException:
        client.close()
        proc.terminate()
        proc.wait(15)
        raise
    return proc, client, held


def serve_oracle(model: str, projector: Path, binary: Path, images: int, max_tokens: int,
                 keep: bool = False) -> dict:
    """Through one `hearth serve` with default settings, every image route, against stock llama-server's OpenAI
    chat (started by stock_beside once serve's runner is loaded by a text request).

    Serve's models folder holds a copy of `model` as SERVE_MODEL and `projector` beside it (paired by name).
    Per format and image: llama-server's answer once, then each API through serve, greedy, the image first."""
    import base64
    import shutil
    import tempfile

    import httpx

    from app.devtools.serve_process import ServeProcess, prepare_data
    from app.engine.media import MEDIA_MARKER
    from app.runner.images import as_png

    root = Path(tempfile.mkdtemp(prefix="hearth-vision-serve-"))
    data, models = root / "data", root / "models"
    models.mkdir()
    # A copy, not a link: the catalog lists one file once, however many names it has.
    shutil.copyfile(model, models / f"{SERVE_MODEL}.gguf")
    shutil.copyfile(projector, models / f"mmproj-{SERVE_MODEL}-f32.gguf")
    token = prepare_data(data, tokens=[("bench", "chat", ["chat"])])["bench"]
    headers = {"Authorization": f"Bearer {token}"}
    serve = proc = theirs = runner = None
    out: dict = {"model_name": SERVE_MODEL, "projector": str(projector), "max_tokens": max_tokens, "rows": []}
    try:
        serve = ServeProcess(data, models, Path(model), root / "serve.log", timeout_s=180)
        warm = serve.client.post("/v1/chat/completions", headers=headers, json={
            "model": SERVE_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hello"}]})
        if warm.status_code != 200:
            raise SystemExit(f"hearth bench vision --serve: serve did not load {SERVE_MODEL}: {warm.text[:500]}")
        proc, theirs, out["held"] = stock_beside(serve, SERVE_MODEL, binary, root)
        runner = httpx.Client(base_url=serve.runner_url(), headers=serve.runner_headers(), timeout=300)
        stock_marker = theirs.get("/props").json()["media_marker"]
        out["ids"] = []
        for fmt, mime in (("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")):
            for seed in range(images):
                image = _encoded(_png(seed, (96, 64)), fmt)
                # Stock llama-server decodes with stb_image, which has no WebP: it gets the PNG of the same pixels.
                stock_image, stock_mime = (as_png(image), "image/png") if fmt == "WEBP" else (image, mime)
                r = theirs.post("/v1/chat/completions",
                                json=api_body("openai", SERVE_MODEL, QUESTION, stock_image, stock_mime, max_tokens))
                r.raise_for_status()
                stock_text, stock_prompt, stock_completion = api_answer("openai", r.json())
                for api, path in SERVE_APIS:
                    a = serve.client.post(path, headers=headers,
                                          json=api_body(api, SERVE_MODEL, QUESTION, image, mime, max_tokens))
                    if a.status_code != 200:
                        raise SystemExit(f"hearth bench vision --serve: {api} answered {a.status_code}: {a.text[:500]}")
                    text, prompt, completion = api_answer(api, a.json())
                    out["rows"].append({
                        "format": fmt, "seed": seed, "api": api, "serve_prompt_tokens": prompt,
                        "stock_prompt_tokens": stock_prompt, "serve_completion_tokens": completion,
                        "stock_completion_tokens": stock_completion, "same_text": text == stock_text,
                        "serve_text": text, "stock_text": stock_text})
                # The generated token ids too, where both servers return them: serve's runner's /completion of the
                # prompt its /apply-template renders, and llama-server's of the same text (its own marker).
                prompt = runner.post("/apply-template", json={"messages": api_body(
                    "openai", SERVE_MODEL, QUESTION, image, mime, max_tokens)["messages"]}).json()["prompt"]
                native = {"n_predict": max_tokens, "temperature": 0, "return_tokens": True}
                ours = runner.post("/completion", json={**native, "prompt": {
                    "prompt_string": prompt, "multimodal_data": [base64.b64encode(image).decode()]}}).json()
                stock = theirs.post("/completion", json={**native, "prompt": {
                    "prompt_string": prompt.replace(MEDIA_MARKER, stock_marker),
                    "multimodal_data": [base64.b64encode(stock_image).decode()]}}).json()
                out["ids"].append({"format": fmt, "seed": seed, "serve_ids": ours.get("tokens"),
                                   "stock_ids": stock.get("tokens"), "serve_prompt_tokens": ours.get("tokens_evaluated"),
                                   "stock_prompt_tokens": stock.get("tokens_evaluated"),
                                   "same_ids": ours.get("tokens") is not None and ours.get("tokens") == stock.get("tokens")})
    finally:
        if runner is not None:
            runner.close()
        if theirs is not None:
            theirs.close()
        if proc is not None:
            proc.terminate()
            proc.wait(15)
        if serve is not None:
            serve.stop()
        if keep:
            print(f"kept {root} (serve.log, llama-server.log, data)")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return out


def identical(row: dict) -> bool:
    """Whether a serve oracle row is the same as llama-server's: prompt tokens, generated tokens and text."""
    return (row["serve_prompt_tokens"] == row["stock_prompt_tokens"] and row["same_text"]
            and row["serve_completion_tokens"] == row["stock_completion_tokens"])


def print_serve_oracle(result: dict) -> None:
    """The table: format × API → prompt tokens serve / llama-server, same text, and the total identical."""
    held = result["held"]
    rows = result["rows"]
    print(f"serve oracle: hearth serve (default settings, {result['model_name']} + {Path(result['projector']).name}) "
          f"against stock llama-server with serve's runner's ctx {held['n_ctx']}, slots {held['slots']}, batch "
          f"{held['n_batch']}, threads {held['threads']}, GPU layers {held['gpu_layers']}, its chat template"
          f"{' (Hearth built-in Gemma 3)' if held['template_is_builtin_gemma3'] else ''}, "
          f"--swa-full; greedy, {result['max_tokens']} tokens, the image before the text")
    print("  llama-server is asked through its OpenAI chat route; WEBP reaches it as the PNG of the same pixels")
    print(f"  {'format':6} {'api':16} {'prompt tokens serve / llama-server':>36} {'generated':>14} {'same text':>10}")
    for fmt in dict.fromkeys(r["format"] for r in rows):
        for api, _ in SERVE_APIS:
            rs = [r for r in rows if r["format"] == fmt and r["api"] == api]
            prompts = ", ".join(f"{r['serve_prompt_tokens']}/{r['stock_prompt_tokens']}" for r in rs)
            generated = ", ".join(f"{r['serve_completion_tokens']}/{r['stock_completion_tokens']}" for r in rs)
            same = sum(r["same_text"] for r in rs)
            print(f"  {fmt:6} {api:16} {prompts:>36} {generated:>14} {'yes' if same == len(rs) else 'no':>5} "
                  f"{same}/{len(rs)}")
    n = sum(identical(r) for r in rows)
    print(f"  {n} of {len(rows)} identical (prompt tokens, generated tokens and text)")
    ids = result.get("ids", [])
    same_ids = sum(r["same_ids"] and r["serve_prompt_tokens"] == r["stock_prompt_tokens"] for r in ids)
    print(f"  token ids: serve's runner's /completion and llama-server's of the same prompt text and image: {same_ids} "
          f"of {len(ids)} the same generated ids and prompt tokens")
    for r in rows:
        if not identical(r):
            print(f"  differs: {r['format']} image {r['seed']} {r['api']}: serve {r['serve_text']!r}, "
                  f"llama-server {r['stock_text']!r}")


def _stream(engine, tokens: list[int], n: int, times: list[float], done: threading.Event) -> None:
    r = engine.submit(tokens, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), class_name="voice",
                      slo=VOICE)
    for ev in engine.events(r, poll_s=0.5):
        if isinstance(ev, Delta) and ev.num_tokens:
            times.append(time.perf_counter())
        elif isinstance(ev, Finished):
            break
    done.set()


def _filler(model, n_tokens: int, seed: int) -> str:
    """A user message whose ChatML prompt has about n_tokens tokens (the text arm's stand-in for an image)."""
    words = [f"Question {seed}:"]
    while len(model.tokenize(" ".join(words), True, True)) < n_tokens - 8:
        words.append("word")
    return " ".join(words)


def pause_round(app, arm: str, seed: int, warm_tokens: int, stream_tokens: int, image_size: tuple[int, int],
                text_tokens: int) -> dict:
    """One round of one arm: the stream's gaps before and while the second request was in flight."""
    engine, client = app.state.engine, Client(app)
    media = engine.media
    media.inline = arm == "inline"
    talk = app.state.model.tokenize("Tell me a long story about a lighthouse keeper and the sea.", True, True)
    times: list[float] = []
    done = threading.Event()
    threading.Thread(target=_stream, args=(engine, talk, stream_tokens, times, done), daemon=True).start()
    while len(times) < warm_tokens and not done.is_set():
        time.sleep(0.001)
    if arm == "text":
        content: object = _filler(app.state.model, text_tokens, seed)
    else:
        # A new image every round: never a prefix-cache hit.
        content = _message(_data_url(_png(1000 + seed, image_size), "image/png"))["content"]
    media.max_decode_ms = 0.0
    media.last_encode_ms = None
    t0 = time.perf_counter()
    answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                        "max_tokens": 1, "temperature": 0}).get_json()
    t1 = time.perf_counter()
    if not done.wait(300):
        raise SystemExit("hearth bench vision: the stream did not finish")
    during = [b - a for a, b in zip(times, times[1:]) if b >= t0 and a <= t1]
    warm = [b - a for a, b in zip(times[:warm_tokens], times[1:warm_tokens])]
    image = arm != "text"
    return {"arm": arm, "seed": seed, "prompt_tokens": answer["usage"]["prompt_tokens"],
            "request_ms": (t1 - t0) * 1000, "longest_gap_ms": max(during, default=0.0) * 1000,
            "median_gap_before_ms": statistics.median(warm) * 1000 if warm else None,
            # The stream's TPOT as the class target reads it: over the whole stream, and over the gaps the image's
            # request overlapped (its encode, its KV decode and its one token).
            "tpot_ms": (times[-1] - times[0]) / (len(times) - 1) * 1000 if len(times) > 1 else None,
            "tpot_during_ms": statistics.fmean(during) * 1000 if during else None,
            "encode_ms": media.last_encode_ms if image else None,
            "image_decode_ms": media.max_decode_ms if image else None,
            "gaps_during_ms": [g * 1000 for g in during]}


def follow_up(model: str, projector: Path, threads: int, ctx: int) -> dict:
    """A second turn about the same image: prompt tokens computed against the new turn's own tokens."""
    app = _runner(model, projector, threads, ctx)
    client = Client(app)
    try:
        image = _data_url(_png(7, (96, 64)), "image/png")
        first_turn = [_message(image)]
        first = client.post("/v1/chat/completions", json={"messages": first_turn, "max_tokens": 16,
                                                          "temperature": 0}).get_json()
        turn = [*first_turn, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And what colour is it mostly?"}]
        second = client.post("/v1/chat/completions", json={"messages": turn, "max_tokens": 16,
                                                           "temperature": 0}).get_json()
        new_turn = second["usage"]["prompt_tokens"] - first["usage"]["prompt_tokens"]
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        return {"first_prompt_tokens": first["usage"]["prompt_tokens"], "second_prompt_tokens":
                second["usage"]["prompt_tokens"], "cached_tokens": cached,
                "computed_tokens": second["usage"]["prompt_tokens"] - cached, "new_turn_tokens": new_turn}
    finally:
        _close(app)


def memory(model: str, projector: Path, threads: int, ctx: int, image_size: int) -> dict:
    """The runner worker's RSS (real `hearth runner` processes) without and with --mmproj, after an image too."""
    import subprocess
    import sys

    import httpx
    import psutil

    out = {}
    for arm, extra in (("text", []), ("vision", ["--mmproj", str(projector)])):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "runner", "--model", model, "--port", str(port),
                                 "--ctx", str(ctx), "--parallel", "2", "--threads", str(threads), *extra],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as c:
                deadline = time.monotonic() + 300
                while True:
                    try:
                        if c.get("/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise SystemExit(f"hearth bench vision: the {arm} runner did not start")
                    time.sleep(0.2)
                workers = psutil.Process(proc.pid).children(recursive=True)
                worker = max(workers, key=lambda p: p.memory_info().rss) if workers else psutil.Process(proc.pid)
                row = {"rss_after_load": worker.memory_info().rss}
                if arm == "vision":
                    c.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [_message(_data_url(
                        _png(5, (image_size, image_size)), "image/png"))]}).raise_for_status()
                    row["rss_after_image"] = worker.memory_info().rss
                else:
                    # A first request touches the text model's compute buffers: the vision arm's after-image
                    # figure is compared with this, so only the image's own memory is left in the difference.
                    c.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
                        {"role": "user", "content": QUESTION}]}).raise_for_status()
                    row["rss_after_request"] = worker.memory_info().rss
                out[arm] = row
        finally:
            proc.terminate()
            proc.wait(30)
    out["projector_file_bytes"] = projector.stat().st_size
    return out


def memory_table(model: str, projectors: list[Path], threads: int, ctx: int) -> list[dict]:
    """Per projector: the runner worker's RSS with it, less the RSS without it (after the load, after one image of
    its own size), beside app.residency.estimate's figures for its weights and its compute."""
    from app.devtools.mmproj import text_embedding_length
    from app.gguf_meta import read_metadata
    from app.residency.estimate import projector_compute_bytes, vision_facts

    rows = []
    for projector in projectors:
        facts = vision_facts(projector)
        if facts is None:
            raise SystemExit(f"hearth bench vision: {projector} has no vision tower in its header")
        mem = memory(model, projector, threads, ctx, facts.image_size)
        weights = projector.stat().st_size
        compute = projector_compute_bytes(projector, text_embedding_length(model))
        rows.append({"projector": str(projector), "name": read_metadata(projector).fields.get("general.name"),
                     "facts": facts.__dict__, "file_bytes": weights, "estimate_compute_bytes": compute,
                     "estimate_bytes": weights + compute,
                     "measured_after_load_bytes": mem["vision"]["rss_after_load"] - mem["text"]["rss_after_load"],
                     "measured_after_image_bytes": mem["vision"]["rss_after_image"] - mem["text"]["rss_after_request"],
                     "raw": mem})
    return rows


def _print_memory(rows: list[dict]) -> None:
    mib = 2**20
    print("projector memory: runner worker RSS with --mmproj less without it (MiB), against the estimate "
          "(app/residency/estimate.py: weights = file, compute = tower buffer + one image)")
    print(f"  {'projector':28} {'px':>4} {'patch':>5} {'width':>5} {'blocks':>6} {'file':>7} {'compute':>8} "
          f"{'estimate':>9} {'load':>7} {'image':>7} {'error':>6}")
    for r in rows:
        f = r["facts"]
        err = 100 * (r["estimate_bytes"] - r["measured_after_image_bytes"]) / r["measured_after_image_bytes"]
        print(f"  {str(r['name'] or Path(r['projector']).name)[:28]:28} {f['image_size']:>4} {f['patch_size']:>5} "
              f"{f['n_embd']:>5} {f['n_layer']:>6} {r['file_bytes'] / mib:>7.1f} {r['estimate_compute_bytes'] / mib:>8.1f} "
              f"{r['estimate_bytes'] / mib:>9.1f} {r['measured_after_load_bytes'] / mib:>7.1f} "
              f"{r['measured_after_image_bytes'] / mib:>7.1f} {err:>+5.0f}%")


def run_from_args(args, model: str) -> int:
    """Print the oracle's table and the pause arms' medians; write everything to --json."""
    with open(model, "rb") as f:
        model_hash = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
    # --serve holds serve's own runner settings (printed with its table), not the command's --threads and --ctx.
    held = "" if args.serve else f", threads {args.threads}, ctx {args.ctx}, slots 2"
    print(f"model {Path(model).name} (first MiB sha256 {model_hash}){held}; machine {machine()}")
    out: dict = {"model": model, "threads": args.threads, "ctx": args.ctx, "machine": machine()}
    if args.memory_only:
        projectors = [Path(p) for p in args.memory_projectors.split(",") if p] if args.memory_projectors else [
            cached_mmproj(model, name) for name in ("mmproj-gemma3-tiny", "mmproj-gemma3-base")]
        out["projector_memory"] = rows = memory_table(model, projectors, args.threads, args.ctx)
        _print_memory(rows)
        return _write(args, out)
    binary = Path(args.llama_server) if args.llama_server else stock_llama_server()
    if args.serve:
        if binary is None:
            raise SystemExit("hearth bench vision --serve: stock llama-server is not built "
                             "(scripts/build_llama_tools.sh), or name it with --llama-server")
        small = cached_mmproj(model, "mmproj-gemma3-tiny")
        out["serve_oracle"] = result = serve_oracle(model, small, binary, args.images or 2, args.max_tokens,
                                                    keep=args.keep)
        print_serve_oracle(result)
        return _write(args, out)
    if not args.skip_oracle:
        small = cached_mmproj(model, "mmproj-gemma3-tiny")
        if binary is None:
            print("oracle: skipped (stock llama-server is not built: scripts/build_llama_tools.sh)")
        else:
            rows = oracle(model, small, args.threads, args.ctx, binary, args.images or 3, args.max_tokens)
            out["oracle"] = {"projector": str(small), "rows": rows}
            print(f"oracle: projector {small.name}, {args.images or 3} images a format, greedy, {args.max_tokens} "
                  "tokens")
            for fmt, rs in rows.items():
                same_count = sum(r["hearth_prompt_tokens"] == r["stock_prompt_tokens"] for r in rs)
                same_text = sum(r["same_text"] and r["hearth_completion_tokens"] == r["stock_completion_tokens"]
                                for r in rs)
                print(f"  {fmt:5} prompt tokens equal {same_count}/{len(rs)} (hearth {rs[0]['hearth_prompt_tokens']}, "
                      f"stock {rs[0]['stock_prompt_tokens']}); generated tokens equal {same_text}/{len(rs)}")
    small = cached_mmproj(model, "mmproj-gemma3-tiny")
    out["follow_up"] = f = follow_up(model, small, args.threads, args.ctx)
    print(f"follow-up turn about the same image: {f['second_prompt_tokens']} prompt tokens, {f['cached_tokens']} "
          f"from the cache, {f['computed_tokens']} computed; the new turn's own tokens: {f['new_turn_tokens']}")
    projector = cached_mmproj(model, args.shape)
    shape = MMPROJ_SHAPES[args.shape]
    if args.skip_pause:
        args.skip_memory = True
    if not args.skip_memory:
        out["memory"] = mem = memory(model, projector, args.threads, args.ctx, shape.image_size)
        mib = 2**20
        print(f"memory ({args.shape}, file {mem['projector_file_bytes'] / mib:.0f} MiB): runner worker RSS "
              f"{mem['text']['rss_after_load'] / mib:.0f} MiB without it, {mem['vision']['rss_after_load'] / mib:.0f} "
              f"MiB with it after the load, {mem['vision']['rss_after_image'] / mib:.0f} MiB after one image")
    if args.skip_pause:
        return _write(args, out)
    print(f"pause: projector {args.shape} ({shape.n_layer} blocks of {shape.n_embd}, {shape.image_size} px, "
          f"{shape.n_image_tokens} image tokens); voice stream, second request after {args.warm_tokens} tokens; "
          f"{args.rounds} rounds, arms interleaved (lab figure: one runner driven directly)")
    app = _runner(model, projector, args.threads, args.ctx)
    results: list[dict] = []
    try:
        # Not measured: the first image pages the projector's weights in and sizes the encode's buffers.
        t0 = time.perf_counter()
        Client(app).post("/v1/chat/completions", json={"messages": [_message(_data_url(
            _png(999, (shape.image_size, shape.image_size)), "image/png"))], "max_tokens": 1})
        out["cold_first_image_ms"] = (time.perf_counter() - t0) * 1000
        print(f"  cold first image (not in the arms): {out['cold_first_image_ms']:.0f} ms")
        text_tokens = 0
        for seed in range(args.rounds):
            for arm in ARMS:
                row = pause_round(app, arm, seed * len(ARMS) + ARMS.index(arm), args.warm_tokens,
                                  args.stream_tokens, (shape.image_size, shape.image_size), text_tokens)
                text_tokens = text_tokens or row["prompt_tokens"]
                results.append(row)
    finally:
        _close(app)
    out["pause"] = {"projector": str(projector), "rows": results}
    # A round whose stream was already slow before the second request came was starved by something else on
    # the machine: its gaps say nothing of the image. Steady rounds: the stream's own pace within 2x the best.
    best = min(r["median_gap_before_ms"] or float("inf") for r in results)
    steady = [r for r in results if r["median_gap_before_ms"] is not None and r["median_gap_before_ms"] <= 2 * best]
    print(f"  all {len(results)} rounds:")
    _print_arms(results)
    print(f"  the {len(steady)} steady rounds (the stream's pace before within 2x the best round's, {best:.1f} ms):")
    _print_arms(steady)
    return _write(args, out)


def _print_arms(results: list[dict]) -> None:
    for arm in ARMS:
        rs = [r for r in results if r["arm"] == arm]
        if not rs:
            print(f"  {arm:6} no round")
            continue
        gaps = sorted(r["longest_gap_ms"] for r in rs)
        print(f"  {arm:6} longest gap of the stream: median {statistics.median(gaps):7.1f} ms "
              f"(min {gaps[0]:.1f}, max {gaps[-1]:.1f}); its median gap before "
              f"{statistics.median([r['median_gap_before_ms'] for r in rs]):.1f} ms; the stream's TPOT median "
              f"{statistics.median([r['tpot_ms'] for r in rs]):.1f} ms, over the gaps the request overlapped "
              f"{statistics.median([r['tpot_during_ms'] for r in rs if r['tpot_during_ms'] is not None] or [0]):.1f}"
              f" ms (voice target {VOICE.tpot_ms:.0f}); prompt {rs[0]['prompt_tokens']} "
              "tokens" + (f"; encode median {statistics.median([r['encode_ms'] for r in rs]):.0f} ms, KV decode "
                          f"median {statistics.median([r['image_decode_ms'] for r in rs]):.1f} ms"
                          if arm != "text" else ""))


def _write(args, out: dict) -> int:
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json_path}")
    return 0
