"""`hearth bench pull`: pulls measured.

- serve (the default): `/healthz` latency through `hearth serve` while a large partial file is
  resumed (its sha256 is computed over the part first, then the rest is downloaded from a loopback
  hub) and `/api/show` is called 50 times a second. The target: /healthz p99 ≤ 100 ms. The part is
  a sparse file (a GGUF header, then zeros), so the bench needs seconds of disk, not gigabytes.
- `--speed`: `curl` and Hearth's pull of the same file from the same loopback hub, interleaved: each
  run's MB/s, the medians and the ratio pull/curl.

Both print their figures as they are measured and a JSON line at the end (`--json` writes it too).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from app.devtools.hub_server import HubServer, tiny_gguf
from app.residency.library import part_path, pull, resolve

HEALTHZ_EVERY_S = 0.02
TARGET_HEALTHZ_P99_MS = 100.0


def say(line: str) -> None:
    """Print a figure as soon as it is measured."""
    print(line, flush=True)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0–100) of `values`, nearest rank; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def run_pull_bench(args, model_path: str) -> int:
    """Run the part of the pull bench asked for; print its figures."""
    result = run_speed(args, Path(model_path)) if args.speed else run_serve(args, Path(model_path))
    line = json.dumps(result)
    print(line)
    if args.json_path:
        Path(args.json_path).write_text(line + "\n")
    return 0 if args.speed or result["healthz_p99_ms"] <= TARGET_HEALTHZ_P99_MS else 1


# -- /healthz while a partial file is resumed ------------------------------------------------------


def _sparse_gguf(path: Path, header_of: Path, size_bytes: int) -> None:
    """A GGUF of `size_bytes`: a real header (the pull checks it) and then a hole of zeros."""
    with open(header_of, "rb") as src, open(path, "wb") as out:
        shutil.copyfileobj(src, out)
        out.truncate(size_bytes)


class _Probe(threading.Thread):
    """GETs or POSTs one path on a schedule (every `every_s`), keeping each answer's latency and status."""

    def __init__(self, url: str, path: str, every_s: float, body: dict | None = None, headers: dict | None = None):
        super().__init__(daemon=True)
        self.url, self.path, self.every_s, self.body, self.headers = url, path, every_s, body, headers or {}
        self.samples: list[tuple[float, float, int]] = []  # (sent at, ms, status)
        self.stop = threading.Event()

    def run(self) -> None:
        """Send on the schedule until stopped (one late answer delays the next, never skips it)."""
        with httpx.Client(base_url=self.url, timeout=30, headers=self.headers) as client:
            due = time.monotonic()
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    r = client.post(self.path, json=self.body) if self.body is not None else client.get(self.path)
                    status = r.status_code
                except httpx.HTTPError:
                    status = 0
                self.samples.append((t0, (time.monotonic() - t0) * 1000, status))
                due += self.every_s
                self.stop.wait(max(0.0, due - time.monotonic()))

    def ms(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """Latencies of the requests sent between `start` and `end` (monotonic seconds)."""
        return [ms for at, ms, _ in self.samples if start <= at < end]


def _figures(name: str, ms: list[float]) -> str:
    return (f"{name}: n {len(ms)}, p50 {percentile(ms, 50):.1f} ms, p99 {percentile(ms, 99):.1f} ms, "
            f"max {max(ms, default=float('nan')):.1f} ms")


def run_serve(args, model_path: Path) -> dict:
    """A partial file of --partial-gb resumed through `hearth serve`'s /api/pull, with /api/show at
    --show-rate per second and /healthz probed every 20 ms; the probes' latencies, before and during."""
    from app.devtools.serve_process import ServeProcess, prepare_data
    from app.gateway.tokens import create_token
    from app.store.db import open_store

    partial = int(args.partial_gb * 2**30)
    total = partial + int(args.rest_mb * 2**20)
    with tempfile.TemporaryDirectory(prefix="hearth-pull-bench-") as tmp:
        root = Path(tmp)
        (root / "hub").mkdir()
        models = root / "models"
        models.mkdir()
        header = tiny_gguf(root / "header.gguf", weights_mib=1)
        source = root / "hub" / "big.gguf"
        _sparse_gguf(source, header, total)
        _sparse_gguf(part_path(models / "big.gguf"), header, partial)
        data = root / "data"
        # The hub is on loopback: allowed, as an admin allows a LAN mirror. The budget is raised so the
        # sparse file's size is not refused as a model too big for this machine.
        prepare_data(data, settings={"api_manage_models": True, "pull_allowed_hosts": "127.0.0.1",
                                     "memory_limit_mb": 1 << 20})
        db_engine, sessions = open_store(data)
        with sessions() as s:
            token, _ = create_token(s, "bench", "chat", may_manage=True)
        db_engine.dispose()
        auth = {"Authorization": f"Bearer {token}"}
        show_name = model_path.stem
        hub = HubServer({"big.gguf": source})
        try:
            serve = ServeProcess(data, models, model_path, root / "serve.log")
            healthz = _Probe(serve.url, "/healthz", HEALTHZ_EVERY_S)
            show = _Probe(serve.url, "/api/show", 1 / args.show_rate, {"model": show_name}, auth)
            try:
                healthz.start()
                time.sleep(args.quiet_s)
                quiet_end = time.monotonic()
                show.start()
                time.sleep(1.0)  # the first show reads the file; the pull starts on a warm cache, as a household's would
                pull_start = time.monotonic()
                statuses = []
                with httpx.stream("POST", serve.url + "/api/pull", headers=auth, timeout=600,
                                  json={"model": f"{hub.url}/files/big.gguf"}) as r:
                    for line in r.iter_lines():
                        if line:
                            statuses.append(json.loads(line))
                pull_end = time.monotonic()
            finally:
                for probe in (healthz, show):
                    probe.stop.set()
                    if probe.is_alive():
                        probe.join()
                serve.stop()
        finally:
            hub.close()
        gets = [(rng, at) for (method, path, rng), at in zip(hub.log, hub.arrived_s)
                if method == "GET" and path.endswith("big.gguf")]
        ranges = [rng for rng, _ in gets]
        # Until the hub is asked for the rest, the pull hashes the part; then it downloads and lands.
        hashed_at = gets[0][1] if gets else pull_end
        landed = (models / "big.gguf").exists()
    last = statuses[-1] if statuses else {}
    quiet = healthz.ms(0, quiet_end)
    during = healthz.ms(pull_start, pull_end)
    shows = show.ms(pull_start, pull_end)
    hashing, downloading = healthz.ms(pull_start, hashed_at), healthz.ms(hashed_at, pull_end)
    show_bad = sum(1 for at, _, status in show.samples if pull_start <= at < pull_end and status != 200)
    result = {"partial_bytes": partial, "total_bytes": total, "pull_s": pull_end - pull_start,
              "pull_outcome": last.get("status") or last.get("error"), "landed": landed, "ranges": ranges,
              "healthz_quiet_p50_ms": percentile(quiet, 50), "healthz_quiet_p99_ms": percentile(quiet, 99),
              "healthz_p50_ms": percentile(during, 50), "healthz_p99_ms": percentile(during, 99),
              "healthz_max_ms": max(during, default=float("nan")), "healthz_n": len(during),
              "hashing_s": hashed_at - pull_start, "healthz_hashing_p99_ms": percentile(hashing, 99),
              "healthz_downloading_p99_ms": percentile(downloading, 99),
              "show_n": len(shows), "show_rate_per_s": len(shows) / max(1e-9, pull_end - pull_start),
              "show_p50_ms": percentile(shows, 50), "show_p99_ms": percentile(shows, 99), "show_not_200": show_bad,
              "cores": os.cpu_count(), "load_average": os.getloadavg()[0]}
    say(f"hearth serve resuming a {partial / 2**30:.2f} GiB partial file (+{args.rest_mb:.0f} MiB from a loopback hub; "
        f"Range {', '.join(str(r) for r in ranges)}), /api/show at {args.show_rate:.0f}/s on {show_name}; "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    say(f"   pull: {result['pull_outcome']} in {result['pull_s']:.1f} s (hashing the part, then the download)")
    say("   " + _figures("/healthz quiet", quiet))
    say("   " + _figures("/healthz during the pull", during) + f" (target p99 ≤ {TARGET_HEALTHZ_P99_MS:.0f} ms)")
    say("   " + _figures(f"   of which hashing the part ({result['hashing_s']:.1f} s)", hashing))
    say("   " + _figures("   of which downloading the rest and landing", downloading))
    say("   " + _figures("/api/show during the pull", shows)
        + f", {result['show_rate_per_s']:.1f}/s achieved, {show_bad} not 200")
    return result


# -- speed against curl ----------------------------------------------------------------------------


def run_speed(args, src_file: Path) -> dict:
    """Pull MB/s against curl's on one loopback URL (the file: --file, else the embedded model)."""
    src_file = Path(args.file) if args.file else src_file
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
    say(f"{size / 1e6:.0f} MB from a loopback hub, {args.reps} interleaved runs each")
    say("curl MB/s: " + ", ".join(f"{mbps(s):.0f}" for s in curl_s) + f" (median {result['curl_mbps_median']:.0f})")
    say("pull MB/s: " + ", ".join(f"{mbps(s):.0f}" for s in pull_s) + f" (median {result['pull_mbps_median']:.0f})")
    say(f"ratio pull/curl: {result['ratio']:.2f}")
    return result
