"""What one request's images cost a vision runner's memory: `python -m app.devtools.engine.image_memory GEMMA.gguf`.

Starts `hearth runner` on the text model with a random Gemma 3 projector (app.devtools.mmproj), then sends, each
after the runner's peak RSS is reset (/proc/PID/clear_refs 5): a small PNG (the baseline), the 16-bit RGBA PNG of
8192×8192 from issue 41 (~520 KB sent, 512 MiB decoded at 16 bits), four of them in one request, and the largest
16-bit PNG the default budget takes (a square of ImageLimits.max_request_pixels). Prints, per request, the status, the time, the runner's RSS before,
its peak during and its RSS after, beside the estimate the Models page shows for the same model, projector, context,
slots and RAM tier (app.residency.estimate.estimate_memory). --runner-root runs another checkout's runner (the
base commit's, for a before/after in one run).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from app.devtools.processes import stop_process

MIB = 1 << 20


def _deep_png(width: int, height: int) -> bytes:
    import struct
    import zlib

    row = b"\0" + struct.pack(">H", 0x8000) * (width * 4)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 16, 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _small_png() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (224, 224), (200, 120, 40)).save(out, format="PNG")
    return out.getvalue()


def _status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and print one JSON object per request, then the estimate."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runner-root", default=None, help="the checkout whose `hearth runner` is measured")
    args = p.parse_args(argv)
    from app.devtools.mmproj import cached_mmproj
    from app.residency.catalog import scan
    from app.residency.estimate import estimate_memory

    model = Path(args.model)
    projector = cached_mmproj(model)
    folder = Path(tempfile.mkdtemp(prefix="hearth-image-memory-"))
    try:
        try:
            os.link(model, folder / model.name)  # the catalog serves no link out of its folder
        except OSError:
            shutil.copyfile(model, folder / model.name)
        shutil.copyfile(projector, folder / f"mmproj-{model.stem}.gguf")
        entry = next(e for e in scan(folder, None) if e.name == model.stem)
        est = estimate_memory(entry, args.ctx, args.parallel)
        port = _free_port()
        env = {**os.environ, "PYTHONPATH": str(Path(args.runner_root or Path(__file__).parents[3]).resolve())}
        runner = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "runner", "-m", str(model), "--mmproj", str(projector), "-c",
             str(args.ctx), "-np", str(args.parallel), "-t", str(args.threads), "--port", str(port),
             "--cache-ram", "0"], env=env, cwd=env["PYTHONPATH"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline or runner.poll() is not None:
                    raise SystemExit("the runner did not start")
                time.sleep(0.2)
            from app.runner.config import ImageLimits

            side = math.isqrt(ImageLimits().max_request_pixels)  # the largest square the default budget takes
            big, largest, small = _deep_png(8192, 8192), _deep_png(side, side), _small_png()
            cases = [("small 224² PNG", [small]), ("8192² 16-bit RGBA PNG", [big]),
                     ("four 8192² 16-bit PNGs", [big] * 4), (f"{side}² 16-bit RGBA PNG", [largest]),
                     ("small 224² PNG again", [small])]
            # The process serving the port (the command may hand the model to a child): the one holding the weights.
            launched = psutil.Process(runner.pid)
            proc = max([launched, *launched.children(recursive=True)], key=lambda q: q.memory_info().rss)
            print(json.dumps({"model": model.name, "projector": projector.name, "ctx": args.ctx,
                              "parallel": args.parallel, "threads": args.threads, "cpu": os.cpu_count(),
                              "runner_root": env["PYTHONPATH"]}))
            for name, images in cases:
                content = [{"type": "text", "text": "What is this?"}] + [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(i).decode()}}
                    for i in images]
                before = proc.memory_info().rss
                Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
                t0 = time.monotonic()
                r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
                    "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0})
                took = time.monotonic() - t0
                st = _status(proc.pid)
                print(json.dumps({"case": name, "bytes_sent": sum(len(i) for i in images), "status": r.status_code,
                                  "seconds": round(took, 2), "rss_before_mib": round(before / MIB),
                                  "peak_mib": round(st["VmHWM"] / MIB), "rss_after_mib": round(st["VmRSS"] / MIB),
                                  "error": (r.json().get("error") or {}).get("message", "")[:160]
                                  if r.status_code != 200 else ""}))
            print(json.dumps({"estimate_total_mib": round(est.total_bytes / MIB),
                              "estimate_projector_compute_mib": round(est.projector_compute_bytes / MIB)}))
        finally:
            family = psutil.Process(runner.pid).children(recursive=True) if runner.poll() is None else []
            stop_process(runner)
            psutil.wait_procs(family, timeout=10)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
