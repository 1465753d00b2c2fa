"""The disk KV tier through real `hearth runner` processes on the real Gemma: a stable system prompt survives a restart."""

import os
import signal
import time

import psutil
import pytest

from tests.helpers import house_system_prompt

pytestmark = pytest.mark.model

# ~1,300 tokens: more than two windows of Gemma 3's sliding window (512).
SYSTEM = house_system_prompt(4)


def tier_metric(runner, name: str, tier: str) -> float:
    """A tier's sample from /metrics."""
    for line in runner.client.get("/metrics").text.splitlines():
        if line.startswith(f'{name}{{tier="{tier}"}} '):
            return float(line.split()[1])
    raise KeyError(name)


def ask(runner, question: str) -> dict:
    """A greedy raw completion after the system prompt; the answer's JSON."""
    res = runner.client.post("/completion", json={"prompt": f"{SYSTEM}\nUser: {question}", "n_predict": 12,
                                                  "temperature": 0.0, "cache_prompt": True, "n_probs": 3})
    assert res.status_code == 200, res.text
    return res.json()


@pytest.fixture
def start(runner_class, gemma_path, tmp_path):
    """Start runners (2,048 cells, 2 slots) with extra flags; every one is stopped after the test."""
    started = []

    def go(*args: str):
        r = runner_class(gemma_path, tmp_path / f"runner{len(started)}.log", "--ctx", "2048", "--parallel", "2",
                         *args).wait_ready()
        started.append(r)
        return r

    yield go
    for r in started:
        if r.proc.poll() is None:
            r.stop()


def test_a_system_prompt_cached_before_a_restart_is_read_from_disk_with_the_same_answer(start, tmp_path):
    disk = tmp_path / "kv"
    first = start("--cache-disk", str(disk))
    ask(first, "Count with me: 1, 2, 3, 4,")
    first.stop()  # SIGTERM: the worker writes what the disk lacks before it exits
    (folder,) = [p for p in disk.iterdir() if p.is_dir()]
    assert [p for p in folder.iterdir() if p.suffix == ".kv"]

    second = start("--cache-disk", str(disk))
    restored = ask(second, "Now the months: January, February, March,")
    assert tier_metric(second, "hearth:kv_tier_hits_total", "disk") == 1
    assert restored["timings"]["cache_n"] > 1000  # the system prompt came from the disk

    # The reference: no tiers; the second question once after the first (a prefix kept in the KV cache) and once
    # alone (a full prefill). The same greedy tokens as both.
    plain = start("--cache-ram", "0")
    ask(plain, "Count with me: 1, 2, 3, 4,")
    kept = ask(plain, "Now the months: January, February, March,")
    alone = start("--cache-ram", "0", "--no-prefix-cache")
    prefilled = ask(alone, "Now the months: January, February, March,")
    assert kept["timings"]["cache_n"] == restored["timings"]["cache_n"]
    assert restored["content"] == kept["content"] == prefilled["content"]
    # The restored cells are the saved bytes: the probabilities are those of the kept prefix, exactly.
    assert restored["completion_probabilities"] == kept["completion_probabilities"]


def kill_minus_9(runner) -> None:
    """SIGKILL the runner's worker (it writes the disk tier) and its arbiter at once: no handler runs."""
    procs = [psutil.Process(runner.proc.pid), *psutil.Process(runner.proc.pid).children(recursive=True)]
    for p in reversed(procs):
        os.kill(p.pid, signal.SIGKILL)
    runner.proc.wait()
    psutil.wait_procs(procs, timeout=10)
    runner.client.close()
    runner._log.close()


def test_a_runner_killed_mid_write_leaves_no_entry_that_is_read_back_and_the_answer_is_unchanged(start, tmp_path):
    disk = tmp_path / "kv"
    questions = [f"Question {i}: which lights are on in room {i}?" for i in range(6)]
    cut_short = None
    for question in questions:  # until a kill lands while a write is in flight
        first = start("--cache-disk", str(disk))
        (folder,) = [p for p in disk.iterdir() if p.is_dir()]
        before = {p.name for p in folder.iterdir()}
        ask(first, question)
        # The engine copies the new prefix out after 1 s idle; its writer thread writes a temporary file,
        # fsyncs it and renames it. Kill -9 the moment a temporary file is there.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            temps = [p for p in folder.iterdir() if p.name.startswith(".tmp-")]
            done = {p.name for p in folder.iterdir() if p.suffix == ".kv"} - before
            if temps or done:
                break
            time.sleep(0.0005)
        kill_minus_9(first)
        temps = [p.name for p in folder.iterdir() if p.name.startswith(".tmp-")]
        if temps:
            cut_short = temps[0]
            break
        for p in folder.iterdir():  # the write won the race: start over without its entry
            if p.suffix == ".kv":
                p.unlink()
    assert cut_short is not None, "no kill landed while a write was in flight"
    half = (folder / cut_short).stat().st_size

    second = start("--cache-disk", str(disk))
    answer = ask(second, question)
    # The half-written file was removed with a warning, never read: the prompt was prefilled.
    assert not (folder / cut_short).exists()
    log = second.log_path.read_text()
    assert f"removing {cut_short}, a write cut short" in log
    assert tier_metric(second, "hearth:kv_tier_hits_total", "disk") == 0
    assert answer["timings"]["cache_n"] == 0
    # Greedy output identical to a runner without tiers.
    plain = start("--cache-ram", "0")
    reference = ask(plain, question)
    assert answer["content"] == reference["content"]
    assert answer["completion_probabilities"] == reference["completion_probabilities"]
    # And serving goes on: the same runner writes the entry whole this time, and a restart reads it back.
    wait_for_entry = time.monotonic() + 60
    while not [p for p in folder.iterdir() if p.suffix == ".kv"]:
        assert time.monotonic() < wait_for_entry, "the second runner never wrote the prefix"
        time.sleep(0.05)
    second.stop()
    third = start("--cache-disk", str(disk))
    again = ask(third, question)
    assert again["timings"]["cache_n"] > 1000 and again["content"] == reference["content"]
    assert half < sum(p.stat().st_size for p in folder.iterdir() if p.suffix == ".kv")
