"""Faults through a real `hearth serve`: a runner killed mid-request, broken and vanishing model files, a
model too big for the budget, a full data folder, and serve itself killed during heavy logging."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import psutil

from app.devtools.serve_process import ServeProcess
from app.residency.catalog import scan
from app.residency.estimate import estimate_memory
from app.store.db import open_store
from app.store.models import Model, RunnerSettings
from tests.helpers import SMALL_RUNNERS, metric, query, wait_until

DEFAULT = "gemma-3-270m-q4_k_m"


def auth(token: str, **extra) -> dict:
    return {"Authorization": f"Bearer {token}", **extra}


def chat(s: ServeProcess, token: str, model: str | None = None, **body) -> httpx.Response:
    payload = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2, "temperature": 0, **body}
    if model:
        payload["model"] = model
    return s.client.post("/v1/chat/completions", json=payload, headers=auth(token))


def rows(data: Path, sql: str, *args) -> list[tuple]:
    return query(data / "hearth.db", sql, *args)


def model_state(s: ServeProcess, token: str, name: str) -> str | None:
    for m in s.client.get("/v1/models", headers=auth(token)).json()["data"]:
        if m["id"] == name:
            return m["hearth"].get("state")
    return None


def gauge(s: ServeProcess, sample: str) -> float:
    """A sample of the serve's /metrics; 0 while it is absent (a counter nothing has counted yet)."""
    return metric(s.client, sample) or 0.0


def test_runner_killed_with_requests_in_flight_fails_each_clearly_and_restarts(start_serve):
    s = start_serve()
    token = s.tokens["alice"]
    assert chat(s, token).status_code == 200
    results: dict = {}

    def whole_answer():
        with httpx.Client(base_url=s.url, timeout=120) as c:
            results["whole"] = c.post("/v1/completions", headers=auth(token),
                                      json={"prompt": "Tell a long story.", "max_tokens": 400, "ignore_eos": True})

    t = threading.Thread(target=whole_answer)
    t.start()
    with s.client.stream("POST", "/v1/completions", headers=auth(token),
                         json={"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                               "stream": True}) as r:
        lines = r.iter_lines()
        assert [next(lines) for _ in range(4)]
        pid = s.runner_arbiters()[0].pid
        for p in s.runner_processes():
            p.kill()
        rest = list(lines)
    t.join(60)
    errors = [json.loads(line[6:]) for line in rest if line.startswith("data: {") and '"error"' in line]
    assert errors and errors[0]["error"]["code"] == "runner_failed"
    assert "restarted on the next request" in errors[0]["error"]["message"]
    whole = results["whole"]
    assert whole.status_code == 502, whole.text
    assert whole.json()["error"]["code"] == "runner_failed"
    # The crash is a state the API shows, then the next request brings the runner back.
    assert model_state(s, token, DEFAULT) in ("crashed", "unloaded")
    assert chat(s, token).status_code == 200
    assert model_state(s, token, DEFAULT) == "ready"

    def crash_and_reload():
        got = rows(s.data, "select event, reason, pid from residency_events where model_name=? order by id", DEFAULT)
        return got if [e[0] for e in got].count("load") == 2 else None

    events = wait_until(crash_and_reload, 30, "the restart's load was never recorded")
    crash = [e for e in events if e[0] == "crash"]
    assert crash and crash[0][2] == pid and crash[0][1]
    assert [e[0] for e in events].count("load") == 2
    wait_until(lambda: ("error", 502) in rows(s.data, "select status, http_status from requests"), 10,
               "the failed request was never recorded")


def test_truncated_and_corrupt_files_get_clear_states_and_the_rest_keeps_serving(start_serve, tmp_path,
                                                                                 gemma_path):
    models = tmp_path / "models"
    models.mkdir()
    raw = gemma_path.read_bytes()
    (models / "truncated.gguf").write_bytes(raw[: len(raw) // 3])  # header intact, weights cut
    (models / "corrupt.gguf").write_bytes(raw[:8] + os.urandom(4096))  # GGUF magic, garbage after
    s = start_serve(models=models)
    token = s.tokens["alice"]
    r = chat(s, token, model="corrupt")
    assert r.status_code == 404 and "cannot be served" in r.json()["error"]["message"], r.text
    assert "corrupt header" in r.json()["error"]["message"]
    # Caught from the header's tensor offsets, before any runner tries to load it.
    r = chat(s, token, model="truncated")
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_unusable" and "truncated" in err["message"] and "the file has" in err["message"]
    assert all("truncated" not in command for _, command in s.runner_commands())
    assert chat(s, token).status_code == 200
    ids = [m["id"] for m in s.client.get("/v1/models", headers=auth(token)).json()["data"]]
    assert DEFAULT in ids and "corrupt" not in ids


def test_model_file_deleted_while_resident(start_serve, tmp_path, gemma_path):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copyfile(gemma_path, models / "gemma-b.gguf")
    s = start_serve(models=models, settings={**SMALL_RUNNERS, "rescan_interval_s": 1})
    token = s.tokens["alice"]
    assert chat(s, token, model="gemma-b").status_code == 200
    runner = next(p for p in s.runner_arbiters() if "gemma-b" in " ".join(p.cmdline()))
    (models / "gemma-b.gguf").unlink()
    # The next rescan drops it: clients are told it is gone, and its runner is let go.
    wait_until(lambda: chat(s, token, model="gemma-b").status_code == 404, 30, "gemma-b was never dropped")
    assert chat(s, token, model="gemma-b").json()["error"]["code"] == "model_not_found"
    assert "gemma-b" not in [m["id"] for m in s.client.get("/v1/models", headers=auth(token)).json()["data"]]
    assert psutil.wait_procs([runner], timeout=30)[1] == []
    wait_until(lambda: ("gemma-b", "unload") in rows(s.data, "select model_name, event from residency_events "
                                                             "where event='unload'"), 30, "the unload was never recorded")
    assert chat(s, token).status_code == 200


def test_a_model_that_does_not_fit_is_refused_with_sizes_and_the_other_keeps_serving(start_serve, tmp_path,
                                                                                     gemma_path):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copyfile(gemma_path, models / "gemma-big.gguf")
    one = estimate_memory(scan(None, gemma_path)[0], SMALL_RUNNERS["runner_ctx"], SMALL_RUNNERS["runner_parallel"]).total_bytes
    data = tmp_path / "data-big"
    engine, sessions = open_store(data)
    with sessions() as db:
        row = Model(name="gemma-big", source="folder", policy="on_demand")
        db.add(row)
        db.flush()
        db.add(RunnerSettings(model_id=row.id, kind="hearth", n_ctx=131072))  # KV alone: far over budget
        db.commit()
    engine.dispose()
    # No RAM tier: its budget would count in both footprints and let the big one fit by evicting the small one.
    s = start_serve(models=models, data=data, settings={**SMALL_RUNNERS, "runner_cache_ram_mib": 0,
                                                        "memory_limit_mb": int(one * 2.5 / 2**20)})
    token = s.tokens["alice"]
    assert chat(s, token).status_code == 200
    r = chat(s, token, model="gemma-big")
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "not_enough_memory" and "MiB" in err["message"], err
    assert r.headers["Retry-After"]
    # Nothing was evicted for a model that could never fit.
    assert model_state(s, token, DEFAULT) == "ready"
    assert chat(s, token).status_code == 200


def test_full_data_folder_serving_continues_losses_counted_and_writing_resumes(start_serve, tmpfs, fill_disk):
    data = tmpfs("data", "48m")
    s = start_serve(data=data)
    token = s.tokens["alice"]
    assert chat(s, token).status_code == 200
    filler = fill_disk(data)
    # Requests and the 1-second samples keep writing; the writer retries, gives up batches by count.
    deadline = time.monotonic() + 60
    while gauge(s, 'hearth:telemetry_lost_total{reason="disk_full"}') == 0:
        assert time.monotonic() < deadline, s.client.get("/metrics").text[-2000:]
        assert chat(s, token).status_code == 200  # serving never waits on the disk
    assert gauge(s, "hearth:telemetry_failing") == 1.0
    assert s.client.get("/healthz").status_code == 200
    filler.unlink()
    before = rows(data, "select count(*) from requests")[0][0]
    assert chat(s, token, max_tokens=3).status_code == 200
    wait_until(lambda: rows(data, "select count(*) from requests")[0][0] > before, 60, "writing never resumed")
    wait_until(lambda: gauge(s, "hearth:telemetry_failing") == 0.0, 30, "telemetry_failing never cleared")
    assert gauge(s, 'hearth:telemetry_lost_total{reason="disk_full"}') > 0  # the count stays for the admin
    assert rows(data, "pragma integrity_check") == [("ok",)]


def test_serve_killed_during_heavy_logging_keeps_every_committed_row_and_leaves_no_runner(start_serve, tmp_path):
    # background: one at a time and a 10 ms queue timeout, so a burst is mostly instant 503s, each one a
    # logged row (a 429 is only counted, not logged).
    s = start_serve(classes={"background": {"max_concurrent": 1, "max_queue": 64, "queue_timeout_s": 0.01}},
                    tokens=[("alice", "chat", ["voice", "background"])])
    token = s.tokens["alice"]
    assert chat(s, token).status_code == 200
    runners = s.runner_processes()
    assert runners and all("--parent-pid" in r.cmdline() for r in runners)
    stop = threading.Event()
    committed: set[int] = set()

    def blast():
        with httpx.Client(base_url=s.url, timeout=30) as c:
            while not stop.is_set():
                try:
                    c.post("/v1/completions", headers=auth(token, **{"X-Hearth-Class": "background"}),
                           json={"prompt": "Hi", "max_tokens": 8})
                except httpx.HTTPError:
                    return

    clients = [threading.Thread(target=blast) for _ in range(6)]
    for t in clients:
        t.start()
    # Committed = visible to another connection: read the ids as the rows land.
    reader = sqlite3.connect(f"file:{s.data / 'hearth.db'}?mode=ro", uri=True)
    deadline = time.monotonic() + 60
    while len(committed) < 300 and time.monotonic() < deadline:
        committed |= {i for (i,) in reader.execute("select id from requests")}
        time.sleep(0.05)
    committed |= {i for (i,) in reader.execute("select id from requests")}
    reader.close()
    assert len(committed) >= 50, len(committed)
    # kill -9 serve's worker and arbiter while the blast goes on: no one stops the runners politely.
    for p in psutil.Process(s.proc.pid).children():
        if p not in runners:
            os.kill(p.pid, signal.SIGKILL)
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait()
    stop.set()
    for t in clients:
        t.join(30)
    _, alive = psutil.wait_procs(runners, timeout=20)
    assert not alive, [p.cmdline() for p in alive]  # the runners' --parent-pid watch ended them
    assert rows(s.data, "pragma integrity_check") == [("ok",)]
    kept = {i for (i,) in rows(s.data, "select id from requests")}
    assert committed <= kept, sorted(committed - kept)[:10]
    # And it starts again on the same folder.
    s2 = start_serve(data=s.data)
    assert chat(s2, s2.tokens["alice"]).status_code == 200
    assert rows(s2.data, "pragma integrity_check") == [("ok",)]
