"""The residency manager with real runners on the real Gemma GGUF: loads, sharing, eviction, expiry, crashes, nodes."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import threading

import httpx
import psutil
import pytest

from app.residency.manager import (
    Lease,
    ModelLoadFailed,
    ModelSpec,
    ModelState,
    NotEnoughMemory,
    ResidencyManager,
    UnknownModel,
)
from app.residency.remote import RemoteNode
from app.residency.runner_spec import RunnerSpec
from app.residency.supervisor import RunnerProcess, free_port, runner_headers
from tests.helpers import wait_until

MiB = 2**20
# Runners the tests start themselves as remote nodes: not the manager's.
NOT_MANAGED: set[int] = set()


def model_file(src, folder, name: str):
    """A second name for the Gemma file: a hard link where possible, else a copy."""
    dst = folder / f"{name}.gguf"
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


def spec(name: str, path, estimate_mib: int = 300, policy: str = "keep_alive", keep_alive_s: float = 300,
         remote=(), local: bool = True) -> ModelSpec:
    """A model with a small local runner (--ctx 512 --parallel 2)."""
    runner = RunnerSpec(model_name=name, model_path=str(path), n_ctx=512, parallel=2, threads=2) if local else None
    return ModelSpec(name=name, path=str(path), estimate_bytes=estimate_mib * MiB, policy=policy,
                     keep_alive_s=keep_alive_s, runner=runner, remote=tuple(remote))


def runner_children() -> list[psutil.Process]:
    """Runners this test process's managers started that are still running."""
    # Managers start runners with --parent-pid <this process>; runners of other test packages'
    # session fixtures (e2e runners, a gateway's serve) are not theirs to count.
    mine = ["--parent-pid", str(os.getpid())]
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            args = p.cmdline()
            owned = any(args[i:i + 2] == mine for i in range(len(args) - 1))
            if p.pid not in NOT_MANAGED and "runner" in args and owned and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def gone(pid: int) -> bool:
    """No such process, or a zombie."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Harness:
    """A manager over a mutable catalog and budget, a settable clock, and the events it emitted."""

    def __init__(self, models: list[ModelSpec], budget_mib: int = 4096, busy_wait_s: float = 0.0):
        self.catalog = {m.name: m for m in models}
        self.budget = budget_mib * MiB
        self.now = 1000.0
        self.events = []
        self.manager = ResidencyManager(lambda: self.catalog, lambda: self.budget, self.events.append,
                                        clock=lambda: self.now, start_timeout_s=120, busy_wait_s=lambda: busy_wait_s)
        # PIDs whose exit a runner's watcher thread has reported to the manager (its last act for that
        # runner): the marker an absence check waits for.
        self.exits_reported: list[int] = []
        on_exit = self.manager._runner_exited

        def record(runner, returncode, expected):
            on_exit(runner, returncode, expected)
            self.exits_reported.append(runner.pid)

        # RunnerProcess is handed manager._runner_exited when a load starts: this instance attribute is what it gets.
        self.manager._runner_exited = record

    def kinds(self, model: str | None = None) -> list[tuple[str, str]]:
        """(model, event) pairs in order."""
        return [(e.model_name, e.event) for e in self.events if model in (None, e.model_name)]

    def state(self, name: str) -> dict:
        """status() of one model."""
        return next(row for row in self.manager.status() if row["name"] == name)


@pytest.fixture
def harness():
    """Factory of harnesses; every manager is shut down and no runner may outlive the test."""
    made: list[Harness] = []

    def make(models: list[ModelSpec], budget_mib: int = 4096, busy_wait_s: float = 0.0) -> Harness:
        h = Harness(models, budget_mib, busy_wait_s)
        made.append(h)
        return h

    yield make
    for h in made:
        h.manager.shutdown()
    wait_until(lambda: not runner_children(), 10, lambda: f"runners left: {runner_children()}")


@pytest.fixture(scope="module")
def remote_runner(gemma_path, tmp_path_factory):
    """A second runner on another port, addressed only by URL: a stand-in for another box."""
    path = model_file(gemma_path, tmp_path_factory.mktemp("remote"), "remote")
    runner = RunnerProcess(RunnerSpec(model_name="gemma", model_path=str(path), n_ctx=512, parallel=2,
                                      threads=2)).start()
    NOT_MANAGED.update(runner.pids())
    yield runner
    runner.stop()


def complete(lease: Lease) -> dict:
    """One short completion through a lease."""
    r = httpx.post(f"{lease.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0},
                   headers=runner_headers(lease.url), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_acquire_loads_serves_records_and_shutdown_stops(harness, gemma_path):
    h = harness([spec("a", gemma_path)])
    lease = h.manager.acquire("a")
    assert lease.node_label == "local" and lease.local and lease.model_name == "a"
    assert complete(lease)["usage"]["completion_tokens"] == 2
    row = h.state("a")
    assert row["state"] == ModelState.READY and row["in_flight"] == 1 and row["pid"] == lease.pid
    assert row["rss_bytes"] > 100 * MiB and row["cold_start_ms"] > 0 and row["log_tail"]
    assert row["nodes"] == [{"label": "local", "url": lease.url, "local": True, "healthy": True, "load": None,
                             "in_flight": 1, "error": None}]
    lease.release()
    lease.release()
    assert h.state("a")["in_flight"] == 0
    [load] = h.events
    assert (load.event, load.node, load.pid, load.estimate_bytes) == ("load", "local", lease.pid, 300 * MiB)
    assert load.measured_bytes > 100 * MiB and load.cold_start_ms > 0
    h.manager.shutdown()
    assert h.kinds() == [("a", "load"), ("a", "unload")] and h.events[-1].reason == "shutdown"
    assert gone(lease.pid) and not runner_children()
    with pytest.raises(ModelLoadFailed, match="shutting down"):
        h.manager.acquire("a")


def test_concurrent_acquires_share_one_load(harness, gemma_path):
    h = harness([spec("a", gemma_path)])
    barrier = threading.Barrier(4)
    leases: list[Lease] = []

    def acquire():
        barrier.wait()
        leases.append(h.manager.acquire("a"))

    threads = [threading.Thread(target=acquire) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(leases) == 4 and len({lease.pid for lease in leases}) == 1
    assert h.kinds() == [("a", "load")]
    assert leases[0].pid in {p.pid for p in runner_children()}
    assert len(runner_children()) == 2  # one arbiter and its worker
    assert h.state("a")["in_flight"] == 4
    for lease in leases:
        lease.release()


def test_budget_that_fits_one_model(harness, gemma_path, tmp_path):
    h = harness([spec("a", gemma_path), spec("b", model_file(gemma_path, tmp_path, "b"))], budget_mib=400)
    a = h.manager.acquire("a")
    # A is busy: B cannot fit, and nothing is evicted.
    with pytest.raises(NotEnoughMemory) as err:
        h.manager.acquire("b")
    message = str(err.value)
    assert "needs 300 MiB" in message and "budget 400 MiB" in message and "a 300 MiB (busy: 1 in flight)" in message
    assert "cannot evict a (busy: 1 in flight)" in message
    assert err.value.blocked == {"a": "busy: 1 in flight"} and err.value.resident == {"a": 300 * MiB}
    assert h.kinds() == [("a", "load")] and not gone(a.pid)
    assert h.state("b")["state"] == ModelState.UNLOADED
    # Once idle, A is the least recently used unpinned model: it goes to make room.
    a.release()
    h.now += 5
    b = h.manager.acquire("b")
    assert h.kinds() == [("a", "load"), ("a", "evict"), ("b", "load")]
    assert h.events[1].reason == "evicted to make room for b" and h.events[1].pid == a.pid
    assert gone(a.pid) and not gone(b.pid)
    assert [h.state(n)["state"] for n in "ab"] == [ModelState.UNLOADED, ModelState.READY]
    b.release()


def test_a_load_waits_for_the_busy_model_in_its_way_and_evicts_it_once_idle(harness, gemma_path, tmp_path):
    # A family member asks the other model just as one's answer is ending: not a 503, a short wait.
    h = harness([spec("a", gemma_path), spec("b", model_file(gemma_path, tmp_path, "b"))], budget_mib=400,
                busy_wait_s=600)
    a = h.manager.acquire("a")
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(h.manager.acquire("b")))
    waiter.start()
    wait_until(lambda: h.manager._idle._waiters, 30, lambda: "b's load is not waiting")  # noqa: SLF001
    assert h.kinds() == [("a", "load")] and not got and not gone(a.pid)
    a.release()
    waiter.join(120)
    assert len(got) == 1 and got[0].model_name == "b"
    assert h.kinds() == [("a", "load"), ("a", "evict"), ("b", "load")] and gone(a.pid)
    got[0].release()


def test_a_load_behind_a_busy_model_is_refused_at_its_deadline_and_a_pinned_one_at_once(harness, gemma_path,
                                                                                       tmp_path):
    h = harness([spec("p", gemma_path, policy="pinned"), spec("a", model_file(gemma_path, tmp_path, "a")),
                 spec("b", model_file(gemma_path, tmp_path, "b"))], budget_mib=700, busy_wait_s=0.2)
    assert h.manager.start_pinned() == {"p": None}
    a = h.manager.acquire("a")
    with pytest.raises(NotEnoughMemory, match=r"cannot evict p \(pinned\), a \(busy: 1 in flight\)") as err:
        h.manager.acquire("b")  # a stays busy past the 0.2 s wait
    assert err.value.busy_only
    a.release()
    h.manager.unload("a")
    h.budget = 500 * MiB
    # Only the pinned model is in the way now: nothing to wait for, refused at once (the wait would be 0.2 s).
    with pytest.raises(NotEnoughMemory, match=r"cannot evict p \(pinned\)") as err:
        h.manager.acquire("b")
    assert not err.value.busy_only


def test_pinned_models_are_never_evicted_or_expired(harness, gemma_path, tmp_path):
    h = harness([spec("p", gemma_path, policy="pinned"), spec("b", model_file(gemma_path, tmp_path, "b"))],
                budget_mib=400)
    assert h.manager.start_pinned() == {"p": None}
    assert h.kinds() == [("p", "load")] and h.events[0].reason == "pinned"
    with pytest.raises(NotEnoughMemory, match=r"cannot evict p \(pinned\)"):
        h.manager.acquire("b")
    h.now += 10**6
    assert h.manager.expire_idle() == []
    assert h.state("p")["state"] == ModelState.READY


def test_keep_alive_expiry_follows_the_clock(harness, gemma_path):
    h = harness([spec("a", gemma_path, keep_alive_s=60)])
    lease = h.manager.acquire("a")
    h.now += 1000
    assert h.manager.expire_idle() == []  # in flight: never expired
    lease.release()
    h.now += 59
    assert h.manager.expire_idle() == []
    h.now += 2
    assert h.manager.expire_idle() == ["a"]
    assert h.kinds() == [("a", "load"), ("a", "unload")] and h.events[-1].reason == "idle 61 s, keep-alive 60 s"
    assert gone(lease.pid) and h.state("a")["state"] == ModelState.UNLOADED
    again = h.manager.acquire("a")
    assert again.pid != lease.pid and h.kinds()[-1] == ("a", "load")
    again.release()


def test_on_demand_unloads_when_the_last_lease_is_released(harness, gemma_path):
    h = harness([spec("a", gemma_path, policy="on_demand")])
    first, second = h.manager.acquire("a"), h.manager.acquire("a")
    first.release()
    assert h.state("a")["state"] == ModelState.READY and not gone(first.pid)
    second.release()
    assert h.kinds() == [("a", "load"), ("a", "unload")]
    assert h.events[-1].reason == "on demand: the last request finished"
    assert gone(first.pid) and h.state("a")["state"] == ModelState.UNLOADED


def test_crashed_runner_is_restarted_by_the_next_acquire(harness, gemma_path):
    h = harness([spec("a", gemma_path)])
    lease = h.manager.acquire("a")
    worker = psutil.Process(lease.pid).children()[0].pid
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: ("a", "crash") in h.kinds(), 10, "the crash was never reported")
    crash = h.events[-1]
    assert crash.pid == lease.pid and crash.reason.startswith("runner exited with code 70")
    assert "exited unexpectedly" in crash.reason  # the runner's own log line, from the tail
    row = h.state("a")
    assert row["state"] == ModelState.CRASHED and row["returncode"] == 70 and row["pid"] is None and row["log_tail"]
    lease.release()
    again = h.manager.acquire("a")
    assert again.pid != lease.pid and complete(again)
    assert h.kinds() == [("a", "load"), ("a", "crash"), ("a", "load")]
    assert h.events[-1].reason == "restart after a crash"
    again.release()


def test_report_failure_marks_a_dead_runner_crashed_once(harness, gemma_path):
    h = harness([spec("a", gemma_path)])
    lease = h.manager.acquire("a")
    h.manager.report_failure(lease, "connection reset")  # alive: one failed request is not a crash
    assert h.state("a")["state"] == ModelState.READY
    os.kill(lease.pid, signal.SIGKILL)
    wait_until(lambda: gone(lease.pid), 10, "the killed runner is still there")
    h.manager.report_failure(lease, "connection refused")
    assert h.state("a")["state"] == ModelState.CRASHED
    # The watcher's report of the same exit must not count twice: once it has reported, nothing new was emitted.
    wait_until(lambda: lease.pid in h.exits_reported, 10, "the runner's watcher never reported its exit")
    assert h.kinds() == [("a", "load"), ("a", "crash")]
    assert h.events[-1].reason.startswith("runner exited with code -9")
    lease.release()
    with h.manager.acquire("a") as again:
        assert complete(again)
    assert h.kinds()[-1] == ("a", "load")


def test_bad_model_file_fails_the_load_with_the_logs_reason(harness, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a GGUF file" * 100)
    h = harness([spec("junk", junk)])
    with pytest.raises(ModelLoadFailed) as err:
        h.manager.acquire("junk")
    assert err.value.name == "junk" and "could not load" in err.value.reason
    assert "--- runner log ---" in err.value.reason
    [event] = h.events
    assert event.event == "load_failed" and "could not load" in event.reason
    row = h.state("junk")
    assert row["state"] == ModelState.FAILED and "could not load" in row["error"] and row["log_tail"]
    assert not runner_children()


def test_a_failed_load_is_not_retried_by_every_request_until_it_cools_down_or_changes(harness, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a GGUF file" * 100)
    # A runner that fails at once (/bin/false as the llama-server binary): what is checked is when the manager starts
    # one, not why it fails (test_bad_model_file_fails_the_load_with_the_logs_reason).
    failing = RunnerSpec(model_name="junk", model_path=str(junk), kind="llama-server", binary_path="/bin/false")
    h = harness([dataclasses.replace(spec("junk", junk), runner=failing)])
    with pytest.raises(ModelLoadFailed) as first:
        h.manager.acquire("junk")
    assert first.value.retry_after_s is None
    # A request 5 s later: the same reason at once, no runner started, and when to try again.
    h.now += 5
    with pytest.raises(ModelLoadFailed) as again:
        h.manager.acquire("junk")
    assert again.value.reason == first.value.reason
    assert again.value.retry_after_s == pytest.approx(h.manager.failed_load_cooldown_s - 5)
    assert h.kinds() == [("junk", "load_failed")]
    # The admin's Load button tries at once.
    with pytest.raises(ModelLoadFailed):
        h.manager.load("junk")
    assert h.kinds() == [("junk", "load_failed")] * 2
    # So does a request once the file is replaced (another size), and one after the cool-down.
    junk.write_bytes(b"still not a GGUF file" * 99)
    with pytest.raises(ModelLoadFailed):
        h.manager.acquire("junk")
    assert h.kinds() == [("junk", "load_failed")] * 3
    h.now += h.manager.failed_load_cooldown_s
    with pytest.raises(ModelLoadFailed):
        h.manager.acquire("junk")
    assert h.kinds() == [("junk", "load_failed")] * 4
    # Changed runner settings are a new try too.
    h.catalog["junk"] = dataclasses.replace(h.catalog["junk"], keep_alive_s=60)
    with pytest.raises(ModelLoadFailed):
        h.manager.acquire("junk")
    assert len(h.kinds()) == 5


def test_unknown_model_and_a_model_larger_than_the_budget(harness, gemma_path):
    h = harness([spec("big", gemma_path, estimate_mib=5000)], budget_mib=4096)
    with pytest.raises(UnknownModel):
        h.manager.acquire("nope")
    with pytest.raises(NotEnoughMemory, match="needs 5000 MiB, budget 4096 MiB, resident 0 MiB"):
        h.manager.acquire("big")
    assert h.events == [] and not runner_children()


def test_load_based_choice_between_local_and_remote(harness, gemma_path, remote_runner):
    h = harness([spec("a", gemma_path, remote=[(remote_runner.url, "nas")])])
    first = h.manager.acquire("a")
    assert first.node_label == "local"  # both idle: the local runner wins the tie
    second = h.manager.acquire("a")
    assert second.node_label == "nas" and second.url == remote_runner.url and complete(second)
    first.release()
    second.release()
    # A request the manager knows nothing about keeps the local runner busy: its /metrics says so.
    local = RemoteNode(first.url)
    stop = threading.Event()

    def stream():
        with httpx.stream("POST", f"{first.url}/v1/completions", timeout=60, headers=runner_headers(first.url),
                          json={"prompt": "Count:", "max_tokens": 400, "stream": True}) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    break

    t = threading.Thread(target=stream)
    t.start()
    try:
        wait_until(lambda: local.load() == 1, 30, "the local runner never reported the stream as its load")
        with h.manager.acquire("a") as lease:
            assert lease.node_label == "nas"
        h.manager.check_nodes()
        assert {n["label"]: n["load"] for n in h.state("a")["nodes"]} == {"local": 1, "nas": 0}
    finally:
        stop.set()
        t.join()


def test_failed_remote_cools_down_then_is_checked_again(harness, gemma_path, remote_runner):
    h = harness([spec("a", gemma_path, remote=[(remote_runner.url, "nas")])])
    busy = h.manager.acquire("a")
    lease = h.manager.acquire("a")
    assert lease.node_label == "nas"
    h.manager.report_failure(lease, "connection reset")
    lease.release()
    assert {n["label"]: n["healthy"] for n in h.state("a")["nodes"]} == {"local": True, "nas": False}
    with h.manager.acquire("a") as other:
        assert other.node_label == "local"  # busier, but the only healthy node
    h.manager.check_nodes()  # still cooling down: not even asked
    assert not h.state("a")["nodes"][1]["healthy"]
    h.now += 11
    h.manager.check_nodes()
    assert h.state("a")["nodes"][1]["healthy"]
    with h.manager.acquire("a") as again:
        assert again.node_label == "nas"
    busy.release()


def test_remote_only_model_and_remote_fallback(harness, gemma_path, remote_runner):
    dead = f"http://127.0.0.1:{free_port()}"
    h = harness([spec("r", gemma_path, local=False, remote=[(remote_runner.url, "nas")]),
                 spec("down", gemma_path, local=False, remote=[(dead, "gone")]),
                 spec("tight", gemma_path, estimate_mib=9000, remote=[(remote_runner.url, "nas")])])
    with h.manager.acquire("r") as lease:
        assert (lease.node_label, lease.url, lease.pid) == ("nas", remote_runner.url, None) and complete(lease)
    with pytest.raises(ModelLoadFailed, match=r"no healthy node: gone \(health check failed\)"):
        h.manager.acquire("down")
    # No room for a local runner, but the remote node can serve it.
    with h.manager.acquire("tight") as lease:
        assert lease.node_label == "nas"
    states = {row["name"]: row["state"] for row in h.manager.status()}
    assert states == {"r": ModelState.READY, "down": ModelState.FAILED, "tight": ModelState.UNLOADED}
    assert h.events == [] and not runner_children()


def test_a_failed_local_load_cooling_down_still_serves_from_the_remote_node(harness, gemma_path, remote_runner):
    failing = RunnerSpec(model_name="m", model_path=str(gemma_path), kind="llama-server", binary_path="/bin/false")
    h = harness([dataclasses.replace(spec("m", gemma_path, remote=[(remote_runner.url, "nas")]), runner=failing)])
    for _ in range(2):  # the second request finds the load cooling down: no new runner, the node serves it
        with h.manager.acquire("m") as lease:
            assert lease.node_label == "nas" and complete(lease)
    assert h.kinds() == [("m", "load_failed")]


def test_client_keep_alive_sets_the_ttl_but_never_unpins(harness, gemma_path):
    h = harness([spec("a", gemma_path, keep_alive_s=60), spec("p", gemma_path, policy="pinned")])
    h.manager.set_client_keep_alive("a", float("inf"))
    h.manager.acquire("a").release()
    assert h.state("a")["expires_in_s"] is None
    h.now += 10**6
    assert h.manager.expire_idle() == []  # kept: the client asked for -1
    h.manager.set_client_keep_alive("a", 5)
    assert h.state("a")["expires_in_s"] == 0  # idle for long already: the next expiry takes it
    assert h.manager.expire_idle() == ["a"] and h.events[-1].reason.endswith("client keep_alive 5 s")
    h.manager.set_client_keep_alive("a", 0)
    lease = h.manager.acquire("a")
    lease.release()
    assert h.kinds("a")[-1] == ("a", "unload") and gone(lease.pid)
    assert h.events[-1].reason == "keep_alive 0 from a client: the last request finished"
    # An unload ends the client's wish: the next residency follows the admin's TTL again.
    h.manager.acquire("a").release()
    assert h.state("a")["expires_in_s"] == 60 and h.state("a")["client_keep_alive_s"] is None
    h.manager.set_client_keep_alive("p", 0)
    h.manager.acquire("p").release()
    h.now += 10**6
    assert h.manager.expire_idle() == ["a"] and h.state("p")["state"] == ModelState.READY


def test_stops_are_told_once_the_runner_is_gone_and_the_first_request_completes_its_load(gemma_path, tmp_path):
    catalog = {"a": spec("a", gemma_path, policy="on_demand"), "b": spec("b", model_file(gemma_path, tmp_path, "b"))}
    events, completed, stopped = [], [], []
    pids: dict[str, int] = {}

    def on_stopped(name: str) -> None:
        # Told after the exit: the process (its mapping of the file) is gone.
        stopped.append((name, gone(pids[name])))

    manager = ResidencyManager(lambda: catalog, lambda: 400 * MiB, events.append, on_first_use=completed.append,
                               on_stopped=on_stopped)
    try:
        # On demand: its first (and only) request completes the load, read before the runner stops.
        with manager.acquire("a") as lease:
            pids["a"] = lease.pid
            complete(lease)
        assert [(e.model_name, e.event) for e in events] == [("a", "load"), ("a", "unload")]
        [first] = completed
        assert first.event == "load" and first.pid == pids["a"] and first.first_prefill_ms > 0
        assert first.kv_source == "none" and first.load_read_ms == events[0].load_read_ms
        assert stopped == [("a", True)]
        # Eviction: B's load makes A's room; a second request on B completes nothing more.
        catalog["a"] = spec("a", gemma_path)
        with manager.acquire("a") as lease:
            pids["a"] = lease.pid
        for _ in range(2):
            with manager.acquire("b") as lease:
                pids["b"] = lease.pid
                complete(lease)
        assert ("a", "evict") in [(e.model_name, e.event) for e in events]
        assert stopped == [("a", True), ("a", True)]
        assert [c.model_name for c in completed] == ["a", "b"]  # A's second load had no request: nothing to complete
    finally:
        manager.shutdown()
    assert stopped[-1] == ("b", True)
