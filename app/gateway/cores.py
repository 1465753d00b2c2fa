"""CoreShare: the local runners share one CPU, so the one serving the household's most urgent request gets it.

Within a runner the engine already serves urgent classes first. Across runners nothing did: a voice transcription on
the audio model's runner and two background streams on the chat model's runner each ran llama.cpp's threads on the
same two cores, and the transcription took 5-7 s instead of 0.5 s (`hearth bench voice-loop`, 2-core Xeon VM).

The rule, in one place: while a request of a class that is not preemptible is in flight on a local runner (or is
being spoken by the TTS process), every other local runner whose requests in flight are all of preemptible classes
less urgent than it is told to hold (POST /hearth/hold, app.runner.hold): its engine pauses between iterations, and
goes on the moment the urgent request ends, a hold's time runs out (HOLD_S), or a request of its own needs it.
Preemptible is the admin's own "this class may wait" switch (documents and background by default); requests on
remote nodes use other CPUs and take no part. The `runner_core_yield` setting turns it off.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from app.residency.supervisor import runner_headers

log = logging.getLogger(__name__)

# How long one hold lasts at most: a hold whose lifting is lost ends by itself (a voice answer takes seconds).
HOLD_S = 60.0
# A runner that does not answer a hold within this is left alone: the urgent request must not wait on it.
SEND_TIMEOUT_S = 0.5
# What stands for serve's own CPU work (the TTS process speaking a voice answer) among the runners.
SERVE = "serve"


@dataclass(frozen=True)
class Work:
    """One request in flight: its class's priority, whether the class is preemptible, where it runs."""

    priority: int
    preemptible: bool
    where: str  # a local runner's URL, or SERVE


def plan(work: list[Work]) -> dict[str, int]:
    """Runner URL → the priority it should hold for: the rule above, for the work in flight now."""
    urgent = [w for w in work if not w.preemptible]
    if not urgent:
        return {}
    top = min(w.priority for w in urgent)
    serving = {w.where for w in urgent if w.priority == top}
    by_runner: dict[str, list[Work]] = {}
    for w in work:
        if w.where != SERVE:
            by_runner.setdefault(w.where, []).append(w)
    return {url: top for url, items in by_runner.items()
            if url not in serving and all(w.preemptible and w.priority > top for w in items)}


class CoreShare:
    """The work in flight and the holds sent; enter() and leave() send what changed, in order."""

    def __init__(self, send: Callable[[str, int | None, float], None], enabled: Callable[[], bool] = lambda: True):
        self._send = send
        self._enabled = enabled
        self._work: dict[int, Work] = {}
        self._held: dict[str, int] = {}
        self._keys = itertools.count()
        # One lock around planning and sending: two changes' messages must reach a runner in the order planned
        # (a late "hold" after a "go on" would pause it for HOLD_S).
        self._lock = threading.Lock()

    def enter(self, priority: int, preemptible: bool, where: str) -> int:
        """A request starts on `where` (a local runner's URL, or SERVE); returns the key to leave() with."""
        key = next(self._keys)
        with self._lock:
            self._work[key] = Work(priority, preemptible, where)
            self._apply()
        return key

    def leave(self, key: int) -> None:
        """The request that entered with this key ended."""
        with self._lock:
            if self._work.pop(key, None) is not None:
                self._apply()

    def held(self) -> dict[str, int]:
        """Runner URL → the priority it was last told to hold for."""
        with self._lock:
            return dict(self._held)

    def _apply(self) -> None:
        wanted = plan(list(self._work.values())) if self._enabled() else {}
        for url in sorted(set(wanted) | set(self._held)):
            if wanted.get(url) == self._held.get(url):
                continue
            try:
                self._send(url, wanted.get(url), HOLD_S)
            except Exception as exc:  # a runner that is gone or slow is left alone; its own work goes on
                log.info("hold of %s not sent: %s", url, exc)
        self._held = wanted


def send_hold(url: str, priority: int | None, for_s: float) -> None:
    """POST /hearth/hold to a local hearth runner, with its key, on a connection of its own (a short timeout, not
    the relay's pool of long-lived ones). Raises on anything but 200."""
    parts = urlsplit(url)
    body = json.dumps({"priority": priority, "for_s": for_s if priority is not None else 0}).encode()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=SEND_TIMEOUT_S)
    try:
        conn.request("POST", "/hearth/hold", body=body, headers={"Content-Type": "application/json",
                                                                   **runner_headers(url)})
        resp = conn.getresponse()
        answer = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {answer[:200]!r}")
    finally:
        conn.close()
