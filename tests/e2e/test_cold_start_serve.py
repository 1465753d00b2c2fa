"""Through `hearth serve` on the embedded GGUF: after a restart, the load's row in residency_events has its phases,
and its first request's KV came back from the disk tier, with the restore and prefill inside the client's wait."""

import sqlite3
import time

import pytest

from tests.helpers import wait_until

pytestmark = pytest.mark.model

PROMPT = ("You are the voice assistant of a family home. These are the devices of the house:\n"
          + "".join(f"- light {i} in room {i % 7}: {'on' if i % 2 else 'off'}\n" for i in range(24)))
COLUMNS = ("cold_start_ms", "load_read_ms", "load_context_ms", "load_upload_ms", "load_restore_ms",
           "first_prefill_ms", "weights_source", "kv_source")


def _completed_load(db_path, timeout_s: float = 60.0) -> dict:
    """The latest load row once its first request has completed it (the writer queues the update)."""
    seen = []

    def completed() -> dict | None:
        with sqlite3.connect(db_path) as con:
            row = con.execute(f"SELECT {', '.join(COLUMNS)} FROM residency_events WHERE event = 'load' "
                              "ORDER BY id DESC LIMIT 1").fetchone()
        seen[:] = [row]
        return dict(zip(COLUMNS, row)) if row is not None and row[COLUMNS.index("first_prefill_ms")] is not None else None

    return wait_until(completed, timeout_s, lambda: f"the load was not completed by its first request: {seen}")


def test_a_load_after_a_serve_restart_is_taken_apart_with_its_kv_from_the_disk(start_serve, models_dir):
    s = start_serve(models_dir)
    hdr = {"Authorization": f"Bearer {s.tokens['alice']}"}
    body = {"model": "gemma-3-270m-q4_k_m", "max_tokens": 4, "temperature": 0}
    r = s.client.post("/v1/completions", headers=hdr, json={**body, "prompt": PROMPT + "Question: is light 3 on?"})
    assert r.status_code == 200, r.text
    first = _completed_load(s.data / "hearth.db")
    assert first["kv_source"] == "none" and first["load_restore_ms"] == 0
    wait_until(lambda: list((s.data / "kv-cache").glob("*/*.kv")), 60, "the disk tier wrote nothing")
    s.stop()

    s2 = start_serve(models_dir, data=s.data, tokens=[])
    t0 = time.monotonic()
    r = s2.client.post("/v1/completions", headers=hdr, json={**body, "prompt": PROMPT + "Question: is light 4 on?"})
    client_ms = (time.monotonic() - t0) * 1000
    assert r.status_code == 200, r.text
    load = _completed_load(s2.data / "hearth.db")
    assert load["kv_source"] == "disk" and load["load_restore_ms"] > 0
    assert load["weights_source"] in ("page_cache", "disk") and load["load_upload_ms"] is None
    assert load["load_read_ms"] > 0 and load["load_context_ms"] > 0 and load["first_prefill_ms"] > 0
    # The load's own phases sit inside its cold start; with the first request's parts, inside the client's wait.
    assert load["load_read_ms"] + load["load_context_ms"] <= load["cold_start_ms"]
    assert load["cold_start_ms"] + load["load_restore_ms"] + load["first_prefill_ms"] <= client_ms


def test_serve_drops_a_cold_models_pages_when_its_runner_stops_and_keeps_a_warm_ones(start_serve, models_dir,
                                                                                     tmp_path):
    from app.devtools.serve_process import prepare_data
    from app.residency.pagecache import cached_fraction
    from tests.helpers import HOUSEHOLD, SMALL_RUNNERS

    data = tmp_path / "data"
    tokens = prepare_data(data, settings=SMALL_RUNNERS, tokens=HOUSEHOLD,
                          policies={"gemma-b": "on_demand", "gemma-3-270m-q4_k_m": "on_demand"})
    with sqlite3.connect(data / "hearth.db") as con:
        con.execute("INSERT INTO runner_settings (model_id, kind, weights) "
                    "SELECT id, 'hearth', 'cold' FROM models WHERE name = 'gemma-b'")
    s = start_serve(models_dir, data=data, tokens=[])
    hdr = {"Authorization": f"Bearer {tokens['alice']}"}
    for model in ("gemma-b", "gemma-3-270m-q4_k_m"):
        r = s.client.post("/v1/completions", headers=hdr, json={"model": model, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    cold = models_dir / "gemma-b.gguf"
    # On demand: each runner stops after its request; serve's warmer (under its gevent loop) drops the cold one.
    wait_until(lambda: cached_fraction(cold) <= 0.1, 60, lambda: f"gemma-b still {cached_fraction(cold):.0%} in the page cache")
    with sqlite3.connect(data / "hearth.db") as con:
        assert con.execute("SELECT count(*) FROM residency_events WHERE event = 'unload'").fetchone() == (2,)
        sources = dict(con.execute("SELECT model_name, weights_source FROM residency_events WHERE event = 'load'"))
    assert set(sources) == {"gemma-b", "gemma-3-270m-q4_k_m"}
    # The warm one is still in memory: its next load reads the page cache.
    r = s.client.post("/v1/completions", headers=hdr, json={"model": "gemma-3-270m-q4_k_m", "prompt": "Hi",
                                                            "max_tokens": 2})
    assert r.status_code == 200, r.text
    with sqlite3.connect(data / "hearth.db") as con:
        assert con.execute("SELECT weights_source FROM residency_events WHERE event = 'load' "
                           "ORDER BY id DESC LIMIT 1").fetchone() == ("page_cache",)
