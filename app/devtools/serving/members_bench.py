"""`hearth bench members`: with one member flooding a class, is another member's request admitted within its TTFT target?

Per round, a fresh `hearth serve` with default classes and settings (except the share under test) on
the embedded model (or --model), pinned, warmed up with one request:

1. quiet: the second member ("alice") sends --probes streamed chat requests one after another;
2. flood: the first member ("script") sends --flood streamed chat requests at once (each generating
   --flood-tokens); once they are admitted or queued, alice sends --probes requests one after another
   while the flood runs.

For alice's requests it prints the admission wait (queue_ms from the request log) and the TTFT her
client measured (arrival → first generated token), against chat's TTFT target; for the flood, how
many were answered and how many refused (429, by code), and how many rows the refusals added to
the store. Rounds: member_class_share at its default (0.5) and, for comparison, 1.0 (one member may
take the whole class, as before members had limits). The client is raw HTTP/1.0 on asyncio.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from app.devtools.serve_process import ServeProcess, prepare_data
from app.devtools.serving.flood import CHAT, Answer, _chat, _request, say

CLASS = "chat"


def _rows(data: Path, sql: str, *args) -> list[tuple]:
    with sqlite3.connect(data / "hearth.db") as db:
        return db.execute(sql, args).fetchall()


def _code(answer: Answer) -> str:
    try:
        return str(json.loads(answer.body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


async def _probes(port: int, token: str, n: int, tokens: int) -> list[Answer]:
    out = []
    for i in range(n):
        headers, body = _chat(token, CLASS, f"Say hello to Alice, number {i}.", tokens)
        out.append(await _request(port, "POST", CHAT, headers, body, timeout_s=600))
    return out


async def _flooded(serve: ServeProcess, tokens: dict[str, str], args) -> tuple[list[Answer], list[Answer], float, int]:
    headers, body = _chat(tokens["script"], CLASS, "Write a long story about a lighthouse.", args.flood_tokens)
    body = json.dumps({**json.loads(body), "ignore_eos": True}).encode()
    flood = [asyncio.create_task(_request(serve.port, "POST", CHAT, headers, body, timeout_s=900))
             for _ in range(args.flood)]
    # The flood is in when every request of it is running, waiting or answered (refusals come back at once).
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:
        text = await asyncio.to_thread(serve.client.get, "/metrics")
        held = sum(float(line.rsplit(" ", 1)[1]) for line in text.text.splitlines()
                   if line.startswith((f'hearth:class_in_flight{{class="{CLASS}"}}',
                                       f'hearth:class_waiting{{class="{CLASS}"}}')))
        done = sum(t.done() for t in flood)
        if held + done >= args.flood:
            break
        await asyncio.sleep(0.1)
    settle_s = time.monotonic() - t0
    alice = await _probes(serve.port, tokens["alice"], args.probes, args.probe_tokens)
    # Evidence that the probes met the flood: how much of it was still running or waiting after the last.
    still = sum(not t.done() for t in flood)
    return alice, await asyncio.gather(*flood), settle_s, still


def _queue_ms(data: Path, since: str, n: int) -> list[float]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = _rows(data, "select queue_ms from requests where member_name = 'alice' and arrival_at >= ? "
                          "and status = 'ok' order by id", since)
        if len(got) >= n:
            return [q or 0.0 for (q,) in got[:n]]
        time.sleep(0.2)
    return []


def _round(args, model_path: str, share: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="hearth-members-") as tmp:
        data, models = Path(tmp) / "data", Path(tmp) / "models"
        models.mkdir()
        tokens = prepare_data(data, tokens=[("script", CLASS, []), ("alice", CLASS, [])],
                              settings={"member_class_share": share}, policies={Path(model_path).stem: "pinned"})
        serve = ServeProcess(data, models, Path(model_path), Path(tmp) / "serve.log")
        try:
            warm = asyncio.run(_probes(serve.port, tokens["alice"], 1, 4))[0]
            if warm.status != 200:
                raise RuntimeError(f"the warm-up request failed: {warm.status} {warm.body[:300]!r}")
            target_ms = _rows(data, "select ttft_target_ms, max_concurrent, max_queue from request_classes "
                                    "where name = ?", CLASS)[0]
            since = _rows(data, "select strftime('%Y-%m-%d %H:%M:%f', 'now')")[0][0]
            quiet = asyncio.run(_probes(serve.port, tokens["alice"], args.probes, args.probe_tokens))
            quiet_q = _queue_ms(data, since, args.probes)
            since = _rows(data, "select strftime('%Y-%m-%d %H:%M:%f', 'now')")[0][0]
            rows_before = _rows(data, "select (select count(*) from requests), (select count(*) from refusals)")[0]
            t0 = time.monotonic()
            alice, flood, settle_s, still = asyncio.run(_flooded(serve, tokens, args))
            flood_s = time.monotonic() - t0
            flood_q = _queue_ms(data, since, args.probes)
            # The refusal counts reach the store with the next flush_refusals job (every 10 s).
            deadline = time.monotonic() + 30
            refused = sum(a.status == 429 for a in flood)
            stored = 0
            while time.monotonic() < deadline:
                stored = _rows(data, "select coalesce(sum(count), 0) from refusals where member_name = 'script'")[0][0]
                if stored >= refused:
                    break
                time.sleep(0.5)
            rows_after = _rows(data, "select (select count(*) from requests), (select count(*) from refusals)")[0]
        finally:
            serve.stop()
    codes: dict[str, int] = {}
    for a in flood:
        key = "200" if a.status == 200 else f"{a.status} {_code(a)}"
        codes[key] = codes.get(key, 0) + 1
    return {"share": share, "ttft_target_ms": target_ms[0], "class_places": target_ms[1], "class_queue": target_ms[2],
            "quiet_ttft_ms": [a.first_token_ms for a in quiet], "quiet_queue_ms": quiet_q,
            "flood_ttft_ms": [a.first_token_ms for a in alice], "flood_queue_ms": flood_q,
            "alice_status": [a.status for a in alice], "flood_codes": codes, "flood_s": flood_s,
            "settle_s": settle_s, "flood_left_after_probes": still, "refused": refused, "refusals_counted": stored,
            "request_rows_added": rows_after[0] - rows_before[0], "refusal_rows_added": rows_after[1] - rows_before[1]}


def _figures(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "none answered"
    return (f"median {statistics.median(got):.0f} ms, max {max(got):.0f} ms "
            f"({', '.join('-' if v is None else f'{v:.0f}' for v in values)})")


def run_members_bench(args, model_path: str) -> int:
    """Run the rounds (member_class_share 0.5, then 1.0 for comparison) and print the figures."""
    say(f"model {model_path}; class {CLASS} as shipped; one member floods it with {args.flood} streamed requests "
        f"({args.flood_tokens} tokens each), another sends {args.probes} ({args.probe_tokens} tokens) during it; "
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}")
    results = []
    for share in args.shares:
        r = _round(args, model_path, share)
        results.append(r)
        ok = [v for v, s in zip(r["flood_ttft_ms"], r["alice_status"]) if s == 200 and v is not None]
        within = sum(v <= r["ttft_target_ms"] for v in ok)
        say(f"-- member_class_share {share:g} (chat: {r['class_places']} running places, queue {r['class_queue']}):")
        say(f"   alice alone:        TTFT {_figures(r['quiet_ttft_ms'])}; admission wait {_figures(r['quiet_queue_ms'])}")
        say(f"   alice during flood: TTFT {_figures(r['flood_ttft_ms'])}; admission wait {_figures(r['flood_queue_ms'])}; "
            f"answers {r['alice_status']}; within chat's TTFT target of {r['ttft_target_ms']} ms: "
            f"{within} of {len(r['alice_status'])}")
        say(f"   the flood ({r['flood_s']:.0f} s, in after {r['settle_s']:.1f} s, {r['flood_left_after_probes']} of it "
            f"still running or waiting after alice's last request): {dict(sorted(r['flood_codes'].items()))}")
        say(f"   store: {r['refused']} refusals counted as {r['refusal_rows_added']} refusals row(s) "
            f"(sum {r['refusals_counted']}); {r['request_rows_added']} request rows (answered, timed out, alice's)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=1))
    return 0
