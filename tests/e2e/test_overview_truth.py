"""The Overview's first screen tells the truth the clients see: through a real `hearth serve` on the embedded model,
8 streams at once, the pace it shows (a token every X ms with every slot busy) against the TPOT the clients measured,
its tok/s against the clients' rate, its chat TTFT p95 against the clients' stopwatch and its KV % against the cells
the clients' prompts and answers hold, each within 20 %. Right after the model loads it says "measuring", never
"out of reach" (issue 45: a fresh box's first look said its voice assistant could not be served)."""

import re
import sqlite3
import statistics
import threading
import time

import httpx
import pytest

from app.web.series import percentile
from tests.helpers import setup_code, wait_until

pytestmark = pytest.mark.model

MODEL = "gemma-3-270m-q4_k_m"
STREAMS = 8
# Room for all 8 prompts and answers with the admission rule's reserve, and their cached prompts between rounds.
CTX = 8192
MAX_TOKENS = 128
TOLERANCE = 0.20
# Distinct prompts of ~300 tokens: 8 of them and their 128-token answers hold a good part of the cells.
PROMPTS = [f"Household note {i}: " + " ".join(f"shelf {j} of room {i} holds item {(i * 31 + j) % 97}." for j in range(40))
           + " Summarise the notes." for i in range(STREAMS)]


@pytest.fixture(scope="module")
def served(start_shared_serve):
    """A fresh serve with 8 slots; chat may run 8 at once for one member."""
    s = start_shared_serve(
        settings={"runner_ctx": CTX, "runner_parallel": STREAMS, "runner_threads": 2, "member_class_share": 1.0},
        classes={"chat": {"max_concurrent": STREAMS}}, tokens=[("alice", "chat", ["voice"])])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def admin(served):
    """An httpx client logged in as the admin (first-run /setup, as a person does it)."""
    client = httpx.Client(base_url=served.url, timeout=60)
    page = client.get("/setup").text
    token = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    r = client.post("/setup", data={"password": "truth admin password", "confirm": "truth admin password",
                                     "csrf_token": token, "setup_code": setup_code(served.data)})
    assert r.status_code == 302, r.text
    yield client
    client.close()


def first_screen(admin) -> str:
    """The first screen as the browser polls it."""
    r = admin.get("/partials/overview/tiles")
    assert r.status_code == 200
    return r.text


def chat_rows(served) -> int:
    """How many chat requests the request log holds (what the first screen's percentiles are taken over)."""
    with sqlite3.connect(served.data / "hearth.db") as con:
        return con.execute("SELECT count(*) FROM requests WHERE class_name = 'chat' AND ttft_ms IS NOT NULL").fetchone()[0]


def number(text: str) -> float:
    return float(text.replace(",", ""))


def shown_pace(html: str) -> tuple[float, int] | None:
    """(ms, slots) of the model's "a token every X ms with N at once", None while measuring."""
    m = re.search(r"a token every ([\d,.]+) ms with (\d+) at once", html)
    return (number(m.group(1)), int(m.group(2))) if m else None


def shown_tok_s(html: str) -> float | None:
    m = re.search(r'class="model-tok-s">([\d,.]+) tok/s', html)
    return number(m.group(1)) if m else None


def shown_kv_pct(html: str) -> float | None:
    m = re.search(r'class="model-kv[^"]*">KV ([\d,.]+) %', html)
    return number(m.group(1)) if m else None


def shown_ttft_p95_ms(html: str, klass: str) -> float | None:
    row = html.split(f'data-class="{klass}"', 1)[1].split("</tr>", 1)[0]
    m = re.search(r'class-ttft"><span class="[^"]*">([\d,.]+) (ms|s)</span>', row)
    if not m:
        return None
    return number(m.group(1)) * (1000 if m.group(2) == "s" else 1)


class Stream:
    """One client's streamed chat answer: its stopwatch (start, first token, last token) and tokens received."""

    def __init__(self, served, prompt: str):
        self.served, self.prompt = served, prompt
        self.start = self.first = self.last = None
        self.received = 0
        self.error = None

    def run(self) -> None:
        body = {"messages": [{"role": "user", "content": self.prompt}], "max_tokens": MAX_TOKENS, "stream": True,
                "ignore_eos": True, "temperature": 0}
        try:
            with httpx.Client(base_url=self.served.url, timeout=300) as client:
                # The connection is open before the stopwatch starts: the gateway's TTFT starts at the request's
                # arrival, and eight threads connecting at once on two cores put tens of ms before it.
                client.get("/healthz").raise_for_status()
                self.start = time.perf_counter()
                with client.stream("POST", "/v1/chat/completions", json=body, headers={
                        "Authorization": f"Bearer {self.served.tokens['alice']}", "X-Hearth-Class": "chat"}) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        # One event per token (a burst of kept draft tokens is several events in one write).
                        if '"content": "' in line and '"content": ""' not in line:
                            now = time.perf_counter()
                            self.first = self.first or now
                            self.last = now
                            self.received += 1
        except Exception as exc:  # surfaced by the test, not lost in a thread
            self.error = exc

    @property
    def ttft_ms(self) -> float:
        return (self.first - self.start) * 1000

    @property
    def tpot_ms(self) -> float:
        return (self.last - self.first) * 1000 / (self.received - 1)


def round_of_streams(served, watch=None) -> list[Stream]:
    """8 streams at once; `watch(streams)` is called in a loop while they all decode (after every first token)."""
    streams = [Stream(served, p) for p in PROMPTS]
    threads = [threading.Thread(target=s.run, daemon=True) for s in streams]
    for t in threads:
        t.start()
    if watch is not None:
        # While every stream decodes (all have their first token, none has ended yet).
        while not any(s.error or s.received >= MAX_TOKENS - 2 for s in streams):
            if all(s.first for s in streams):
                watch(streams)
            else:
                time.sleep(0.05)
    for t in threads:
        t.join(300)
    for s in streams:
        assert s.error is None, s.error
        assert s.received >= MAX_TOKENS - 2, (s.received, "tokens: ignore_eos answers every token it was asked for")
    return streams


def within(shown: float, measured: float) -> bool:
    return abs(shown - measured) <= TOLERANCE * measured


def test_the_first_screen_shows_what_the_clients_measured(served, admin):
    # Right after install, nothing loaded and no traffic: no class is out of reach.
    assert "reach-out" not in first_screen(admin)
    # The first requests load the model: its pace is measured only from warm iterations, so it says "measuring".
    prompt_tokens = []
    with httpx.Client(base_url=served.url, timeout=300,
                      headers={"Authorization": f"Bearer {served.tokens['alice']}", "X-Hearth-Class": "voice"}) as c:
        for p in PROMPTS:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": p}], "max_tokens": 1})
            assert r.status_code == 200, r.text
            prompt_tokens.append(r.json()["usage"]["prompt_tokens"])
    def model_line() -> str | None:
        html = first_screen(admin)
        return html if f'data-model="{MODEL}"' in html and "answering" in html else None

    html = wait_until(model_line, timeout_s=30, message="the model's line on the first screen")
    assert "pace: measuring" in html and "reach-out" not in html

    warm = round_of_streams(served)  # the cost fit gets its iterations at 8 streams
    samples: list[tuple[float | None, float | None, float]] = []

    def watch(streams):
        html = first_screen(admin)
        # What the clients' prompts and answers hold at this moment, in the KV cache's cells.
        held = sum(p + s.received for p, s in zip(prompt_tokens, streams))
        samples.append((shown_tok_s(html), shown_kv_pct(html), 100 * held / CTX))
        time.sleep(0.3)

    measured = round_of_streams(served, watch)
    # The pace is the median period of the runner's last 64 full decode-only iterations: the measured round's.
    client_tpot = statistics.median(st.tpot_ms for st in measured)
    client_tok_s = sum(1000 / st.tpot_ms for st in measured)

    # The pace, once the sampler has read the runner after the round.
    pace = wait_until(lambda: shown_pace(first_screen(admin)), timeout_s=30, message="the measured pace")
    starts = sorted(round((st.first - measured[0].start) * 1000) for st in measured)
    print(f"\nshown pace {pace[0]} ms with {pace[1]} at once; clients' median TPOT {client_tpot:.1f} ms (warm round: "
          f"{sorted(round(st.tpot_ms, 1) for st in warm)}, measured round: {sorted(round(st.tpot_ms, 1) for st in measured)}); "
          f"first tokens at {starts} ms")
    print(f"first screen samples (tok/s, KV %, clients' cells %): {samples}; clients' rate {client_tok_s:.1f} tok/s")
    tok_s = [t for t, _, _ in samples[len(samples) // 4:] if t]  # past the sampler's first second of the round
    kv = [(shown, held) for _, shown, held in samples if shown]
    assert pace[1] == STREAMS and tok_s and kv, (samples, starts)
    shown_kv, held_kv = statistics.median(s for s, _ in kv), statistics.median(h for _, h in kv)
    # TTFT p95 over the chat class's 16 requests (both rounds), nearest rank as the Overview computes it.
    clients_ttft = sorted(s.ttft_ms for s in warm + measured)
    clients_p95 = percentile(clients_ttft, 95)
    # The request log is written by the one store writer, off the serving path: the screen counts a request
    # once its row is stored (CI once read it with only the first round's 8 rows there).
    wait_until(lambda: chat_rows(served) >= 2 * STREAMS, timeout_s=30, message="the 16 chat requests' rows")
    shown_ttft = shown_ttft_p95_ms(first_screen(admin), "chat")
    print(f"chat TTFT p95: shown {shown_ttft} ms, clients {clients_p95:.0f} ms (all: {[round(t) for t in clients_ttft]})")
    figures = {  # shown on the first screen, measured by the clients
        "pace ms": (pace[0], client_tpot), "tok/s": (statistics.median(tok_s), client_tok_s),
        "KV %": (shown_kv, held_kv), "chat TTFT p95 ms": (shown_ttft, clients_p95)}
    print(figures)
    off = {name: pair for name, pair in figures.items() if pair[0] is None or not within(*pair)}
    assert not off, f"first-screen figures more than 20 % from what the clients measured: {off}"
