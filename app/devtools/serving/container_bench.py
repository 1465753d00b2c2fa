"""`hearth bench container`: the image's size, and decode speed inside the container against the bare-metal runner on
the same box, model, threads and context (the image's llama.cpp is built for the CPU family, the bare-metal wheel for
this machine's CPU: the ratio is what a household gives up by installing the container).

Both runners are `hearth runner` on the embedded Gemma 3 270M (assembled inside the container from the image's own
chunks), one slot, greedy raw completions of --tokens tokens with ignore_eos, timed by this client from the first
streamed token to the last; rounds alternate bare metal and container, and each side's best is kept.
"""

from __future__ import annotations

import json
import sys
import time

import httpx

from app.devtools import container
from app.devtools.processes import stop_process, wait_healthy
from app.hardware import machine
from app.residency.supervisor import free_port

PROMPT = "The household's shared server keeps the right models resident and"


def add_arguments(parser) -> None:
    """The flags of `hearth bench container`."""
    parser.add_argument("--image", default=None, help="image tag (default: docker-compose.yml's)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per completion (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds, best kept (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _decode_rate(url: str, tokens: int) -> float:
    """Tokens per second between the first and the last streamed token of one greedy completion."""
    times = []
    body = {"prompt": PROMPT, "n_predict": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "cache_prompt": False}
    with httpx.stream("POST", f"{url}/completion", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def run(args) -> int:
    """Print the image size and decode tok/s bare metal against in the container."""
    import subprocess

    import yaml

    from app.residency.default_model import ensure_default_model

    image = args.image or yaml.safe_load((container.REPO / "docker-compose.yml").read_text())["services"]["hearth"]["image"]
    container.ensure_engine()
    if not container.image_exists(image):
        raise SystemExit(f"hearth bench container: no image {image} (pytest -m container builds it, or docker build .)")
    size = container.image_size_bytes(image)
    model = ensure_default_model(container.CACHE / "bench-data", progress=False)
    common = ["--ctx", str(args.ctx), "--parallel", "1", "--threads", str(args.threads)]
    bare_port, box_port = free_port(), free_port()
    bare = subprocess.Popen([sys.executable, "-m", "app.cli", "runner", "--model", str(model), "--port", str(bare_port),
                             *common], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    name = f"hearth-bench-{box_port}"
    script = ("M=$(python -c \"from pathlib import Path; from app.residency.default_model import ensure_default_model "
              "as e; print(e(Path('/tmp/hearth-bench'), progress=False))\") && exec hearth runner --model \"$M\" "
              f"--host 0.0.0.0 --port {box_port} {' '.join(common)}")
    container.docker("run", "-d", "--rm", "--name", name, "-p", f"127.0.0.1:{box_port}:{box_port}",
                     "--entrypoint", "sh", image, "-c", script)
    rates: dict[str, list[float]] = {"bare metal": [], "container": []}
    urls = {"bare metal": f"http://127.0.0.1:{bare_port}", "container": f"http://127.0.0.1:{box_port}"}
    try:
        wait_healthy(urls["bare metal"], lambda: None if bare.poll() is None else f"code {bare.returncode}", 300,
                     "the bare-metal runner", interval_s=0.2)
        wait_healthy(urls["container"], lambda: None if container.docker("inspect", name, check=False).returncode == 0
                     else "the container is gone", 300, "the container's runner", interval_s=0.2)
        for url in urls.values():
            _decode_rate(url, 16)  # warm-up: page cache, threads
        for rnd in range(args.rounds):
            for side in (urls if rnd % 2 == 0 else list(reversed(urls))):
                rates[side].append(_decode_rate(urls[side], args.tokens))
    finally:
        stop_process(bare)
        container.docker("rm", "-f", name, check=False)
    best = {side: max(values) for side, values in rates.items()}
    doc = {"image": image, "image_bytes": size, "tokens": args.tokens, "rounds": args.rounds, "threads": args.threads,
           "ctx": args.ctx, "model": str(model), "rates": rates, "best": best,
           "ratio": best["container"] / best["bare metal"] if best["bare metal"] else None, "machine": machine()}
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"image {image}: {size / 1e6:.0f} MB (the embedded model's chunks included)")
    print(f"held: embedded Gemma 3 270M Q4_K_M, --ctx {args.ctx} --parallel 1 --threads {args.threads}, greedy, "
          f"{args.tokens} tokens, ignore_eos; {args.rounds} alternating rounds, best kept; CPU {machine().get('cpu')}")
    for side, values in rates.items():
        print(f"{side:<11} decode {best[side]:7.1f} tok/s (runs: {', '.join(f'{v:.1f}' for v in values)})")
    print(f"container / bare metal: {doc['ratio']:.3f}")
    return 0
