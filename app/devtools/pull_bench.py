"""Pull speed, measured: `curl` and Hearth's pull of the same file from the same loopback hub, interleaved.

Run: python -m app.devtools.pull_bench [FILE] [--reps N]. FILE defaults to the embedded Gemma GGUF
(250 MB). Prints each run's MB/s, the medians, the spread and the ratio pull/curl, and JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from app.devtools.hub_server import HubServer
from app.residency.library import pull, resolve


def main(argv: list[str] | None = None) -> int:
    """Print pull MB/s against curl's on one loopback URL."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("file", nargs="?", default=None)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    if args.file is None:
        from app.paths import data_dir
        from app.residency.default_model import ensure_default_model

        args.file = str(ensure_default_model(data_dir(), progress=False))
    src_file = Path(args.file)
    name = src_file.name if src_file.name.endswith(".gguf") else src_file.name + ".gguf"
    hub = HubServer({name: src_file})
    size = src_file.stat().st_size
    curl_s, pull_s = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            source = resolve(f"owner/repo/{name}", endpoint=hub.url)
            for _ in range(args.reps):
                t0 = time.perf_counter()
                subprocess.run(["curl", "-sS", "-o", str(out / "curl.bin"), source.url], check=True)
                curl_s.append(time.perf_counter() - t0)
                (out / "curl.bin").unlink()
                models = out / "models"
                models.mkdir()
                t0 = time.perf_counter()
                pull(source, models)  # sha256 checked, as every pull is
                pull_s.append(time.perf_counter() - t0)
                shutil.rmtree(models)
    finally:
        hub.close()
    mbps = lambda s: size / s / 1e6  # noqa: E731
    result = {"file": str(src_file), "size_bytes": size, "curl_s": curl_s, "pull_s": pull_s,
              "curl_mbps_median": mbps(statistics.median(curl_s)), "pull_mbps_median": mbps(statistics.median(pull_s))}
    result["ratio"] = result["pull_mbps_median"] / result["curl_mbps_median"]
    print(f"{size / 1e6:.0f} MB from a loopback hub, {args.reps} interleaved runs each")
    print("curl MB/s: " + ", ".join(f"{mbps(s):.0f}" for s in curl_s) + f" (median {result['curl_mbps_median']:.0f})")
    print("pull MB/s: " + ", ".join(f"{mbps(s):.0f}" for s in pull_s) + f" (median {result['pull_mbps_median']:.0f})")
    print(f"ratio pull/curl: {result['ratio']:.2f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
