"""Tests for app.engine.kv_tiers: the host-RAM tier under the prefix cache, driven through the engine on a fake model.

The fake model's next token is a function of the tokens its cells hold, so a restore that put back the
wrong cells (or cells at the wrong positions) changes the answer; its violations catch holes and misuse.
"""

import logging

import pytest
from fake_model import FakeModel
from test_engine_fake import collect, greedy

from app.engine.engine import Engine
from app.engine.kv_tiers import MIB, DiskTier, RamTier, SavedPrefix, cache_ram_bytes
from tests.helpers import wait_until

TRANSFER = 4  # 2 × n_seq_max, as LlamaModel reserves it


@pytest.fixture
def make_engine():
    """Engines on fake models, started, and stopped after the test."""
    engines: list[Engine] = []

    def factory(model: FakeModel, **kwargs) -> Engine:
        engine = Engine(model, clock=model.clock, **kwargs).start()
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.stop()


def quick_disk(*args, **kwargs) -> DiskTier:
    """A disk tier the idle engine writes to after 10 ms, not a second (what the tests wait on is the write)."""
    return DiskTier(*args, idle_write_delay_s=0.01, **kwargs)


def long_prompt(tag: int, n: int = 40) -> list[int]:
    """A prompt of n tokens whose every token depends on its tag (no shared prefix between tags)."""
    return [tag * 1000 + i for i in range(n)]


def run(engine: Engine, tokens: list[int], n: int = 4):
    """Submit, wait, and return (output tokens, cached prompt tokens)."""
    r = engine.submit(tokens, greedy(n, ignore_eos=True))
    _, fin = collect(r)
    assert fin.error is None
    return r.output_tokens, fin.stats.num_cached_tokens


def small_model(**kwargs) -> FakeModel:
    """64 cells: one 40-token prompt's entry leaves no room for a second, so the first is evicted."""
    return FakeModel(n_ctx=64, n_batch=64, n_seq_max=2, transfer_seq=TRANSFER, **kwargs)


def test_an_evicted_prefix_comes_back_from_ram_with_the_same_answer(make_engine):
    model = small_model()
    engine = make_engine(model, cache_ram_bytes=None)
    a, b = long_prompt(1), long_prompt(2)
    first, cached = run(engine, a)
    assert cached == 0
    run(engine, b)  # needs the cells of a's entry: it is evicted, and saved
    assert engine.tiers.counters.saves_total == 1 and len(engine.tiers.ram) == 1
    again, cached = run(engine, a + [7, 8, 9])
    # Everything a's entry shared with the new prompt came back (its 40 prompt tokens and the 3 outputs
    # computed before the 4th ended it); only what is new was computed.
    assert cached == 40
    assert engine.tiers.counters.hits_total == 1 and engine.tiers.counters.restored_tokens_total == 40
    assert model.num_state_loads == 1
    fresh = FakeModel(n_ctx=64, n_batch=64, n_seq_max=2)
    assert again == fresh.expected_tokens(a + [7, 8, 9], 4)
    assert first == fresh.expected_tokens(a, 4)
    # b was evicted by the restore in turn, and comes back too.
    _, cached_b = run(engine, b)
    assert cached_b == 39 and engine.tiers.counters.hits_total == 2
    assert model.violations == [] and engine.scheduler.cache.check() == []
    assert model.seqs.get(TRANSFER, []) == []  # the transfer sequence is left empty


def test_no_tier_when_off_or_when_the_model_cannot_save_states(make_engine):
    off = make_engine(small_model(), cache_ram_bytes=0)
    no_states = make_engine(FakeModel(n_ctx=64, n_batch=64, n_seq_max=2), cache_ram_bytes=None)
    no_cache = make_engine(small_model(), cache_ram_bytes=None, prefix_cache=False)
    assert off.tiers is None and no_states.tiers is None and no_cache.tiers is None
    a, b = long_prompt(1), long_prompt(2)
    run(off, a)
    run(off, b)
    _, cached = run(off, a)
    assert cached == 0  # evicted and gone: prefilled again


def test_a_refused_restore_is_prefilled_and_the_saved_prefix_dropped(make_engine, caplog):
    model = small_model()
    engine = make_engine(model, cache_ram_bytes=None)
    a, b = long_prompt(1), long_prompt(2)
    first, _ = run(engine, a)
    run(engine, b)
    model.refuse_states = True
    again, cached = run(engine, a)
    assert cached == 0 and again == first
    assert engine.tiers.counters.failures_total == 1 and engine.tiers.counters.hits_total == 0
    assert "refused a saved prefix" in caplog.text
    assert model.violations == [] and engine.scheduler.cache.check() == []
    assert model.seqs.get(TRANSFER, []) == [] and model.seqs.get(0, []) == []


def test_a_kv_hit_longer_than_the_tier_s_leaves_the_tier_alone(make_engine):
    model = small_model()
    engine = make_engine(model, cache_ram_bytes=None)
    a = long_prompt(1, 20)
    run(engine, a)
    _, cached = run(engine, a + [5])
    assert cached == 20 and engine.tiers.counters.hits_total == 0 and model.num_state_loads == 0


def saved(tokens: list[int], size: int) -> SavedPrefix:
    """A saved prefix of `size` bytes."""
    return SavedPrefix(tokens, len(tokens), [bytearray(size)], 0.0)


def test_the_ram_tier_drops_least_recently_used_and_never_holds_more_than_its_budget():
    tier = RamTier(max_bytes=100)
    x, y, z = saved([1] * 20, 40), saved([2] * 20, 40), saved([3] * 20, 40)
    assert tier.put(x) and tier.put(y)
    tier.touch(x)  # y is now the least recently used
    assert tier.put(z)
    assert tier.num_bytes == 80 <= 100 and x in tier and z in tier and y not in tier
    assert tier.num_dropped == 1
    assert not tier.put(saved([4] * 20, 101))  # larger than the whole budget: refused, nothing dropped
    assert tier.num_bytes == 80 and len(tier) == 2


def test_the_ram_tier_keeps_one_copy_of_a_prefix_and_finds_the_longest_share():
    tier = RamTier(max_bytes=None)
    short = saved(list(range(20)), 10)
    longer = saved(list(range(30)), 10)
    assert tier.put(short) and tier.put(longer)
    assert short not in tier and len(tier) == 1  # the longer one restores every prefix of it
    assert tier.put(saved(list(range(25)), 10)) and len(tier) == 1  # covered by what is held
    best, n = tier.best(list(range(26)) + [99])
    assert best is longer and n == 26
    assert tier.best([5, 6, 7]) == (None, 0)


def test_cache_ram_takes_llama_server_s_values():
    assert cache_ram_bytes(-1) is None and cache_ram_bytes(0) == 0 and cache_ram_bytes(3) == 3 * MIB
    with pytest.raises(ValueError, match="-1 .no limit."):
        cache_ram_bytes(-2)


# -- the disk tier --------------------------------------------------------------------------------

KEY = {"format": 1, "model": "fake.gguf", "size": 1, "mtime_ns": 1, "template_sha256": "t", "n_ctx": 64}


def wait_for(condition, timeout_s: float = 10.0) -> None:
    """Poll a condition until it holds (or fail after timeout_s)."""
    wait_until(condition, timeout_s, every_s=0.01)


def first_session(make_engine, root, key=KEY) -> tuple[list[int], DiskTier]:
    """A runner's life: one request, the engine idle (its prefix written), then stopped."""
    disk = quick_disk(root, key, max_bytes=None)
    engine = make_engine(small_model(), cache_ram_bytes=None, cache_disk=disk)
    out, _ = run(engine, long_prompt(1))
    wait_for(lambda: disk.holds(long_prompt(1)))
    assert disk.flush()
    engine.stop()
    disk.close()
    return out, disk


def only_file(disk: DiskTier):
    (path,) = [p for p in disk.dir.iterdir() if p.suffix == ".kv"]
    return path


def test_a_prefix_written_to_disk_survives_a_restart(make_engine, tmp_path):
    first, disk = first_session(make_engine, tmp_path)
    assert len(disk) == 1 and disk.num_written == 1
    assert not [p for p in disk.dir.iterdir() if p.name.startswith(".tmp-")]
    # The next process: a new model (empty KV cache), the same key.
    model = small_model()
    disk2 = quick_disk(tmp_path, dict(KEY), max_bytes=None)
    engine = make_engine(model, cache_ram_bytes=None, cache_disk=disk2)
    again, cached = run(engine, long_prompt(1) + [7, 8])
    assert cached == 40 and engine.tiers.counters.disk_hits_total == 1
    assert again == FakeModel(n_ctx=64, n_batch=64, n_seq_max=2).expected_tokens(long_prompt(1) + [7, 8], 4)
    assert model.violations == [] and engine.scheduler.cache.check() == []
    disk2.close()


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "not an entry"])
def test_a_damaged_entry_is_dropped_with_a_warning_and_the_prompt_prefilled(make_engine, tmp_path, caplog, damage):
    first, disk = first_session(make_engine, tmp_path)
    path = only_file(disk)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) - 7]
    elif damage == "corrupted":
        data[-3] ^= 0xFF  # same size, so only the checksum can tell
    else:
        data[:4] = b"JUNK"
    path.write_bytes(bytes(data))
    disk2 = quick_disk(tmp_path, dict(KEY), max_bytes=None)
    engine = make_engine(small_model(), cache_ram_bytes=None, cache_disk=disk2)
    again, cached = run(engine, long_prompt(1))
    assert cached == 0 and again == first  # no wrong output: computed again
    assert "KV disk tier: dropping" in caplog.text and disk2.num_bad == 1
    assert engine.tiers.counters.disk_hits_total == 0
    assert not path.exists() or path.read_bytes() != bytes(data)  # the damaged file is gone (or rewritten whole)
    again2, _ = run(engine, long_prompt(2))  # serving goes on
    assert again2 == FakeModel(n_ctx=64, n_batch=64, n_seq_max=2).expected_tokens(long_prompt(2), 4)
    disk2.close()


def test_a_changed_model_or_setting_never_reads_the_old_entries(make_engine, tmp_path):
    first_session(make_engine, tmp_path)
    for change in ({"mtime_ns": 2}, {"n_ctx": 128}, {"template_sha256": "u"}):
        disk = quick_disk(tmp_path, {**KEY, **change}, max_bytes=None)
        assert len(disk) == 0  # another folder
        engine = make_engine(small_model(), cache_ram_bytes=None, cache_disk=disk)
        _, cached = run(engine, long_prompt(1))
        assert cached == 0
        engine.stop()
        disk.close()
    assert len(quick_disk(tmp_path, dict(KEY), max_bytes=None)) == 1  # the old entry is still there for its key


def test_an_entry_of_another_key_in_the_folder_is_refused(make_engine, tmp_path, caplog):
    _, disk = first_session(make_engine, tmp_path)
    other = quick_disk(tmp_path, {**KEY, "n_ctx": 128}, max_bytes=None)
    only_file(disk).rename(other.dir / only_file(disk).name)  # a file copied into the wrong folder
    other2 = quick_disk(tmp_path, {**KEY, "n_ctx": 128}, max_bytes=None)
    assert len(other2) == 0 and "another model or KV settings" in caplog.text


def test_a_half_written_temporary_file_is_never_read_and_is_cleaned_up(tmp_path):
    disk = quick_disk(tmp_path, KEY, max_bytes=None)
    (disk.dir / ".tmp-0123.kv").write_bytes(b"HEARTHKV1\n half an entry")
    disk.close()
    disk2 = quick_disk(tmp_path, KEY, max_bytes=None)
    assert len(disk2) == 0 and not (disk2.dir / ".tmp-0123.kv").exists()


def test_the_disk_tier_drops_least_recently_used_entries_to_stay_within_its_budget(tmp_path):
    disk = quick_disk(tmp_path, KEY, max_bytes=2600)  # room for two files of ~1,260 bytes (states, tokens, header)
    for tag in (1, 2, 3):
        disk.submit(saved(long_prompt(tag, 20), 1000))
        assert disk.flush()
    assert len(disk) == 2 and disk.num_bytes <= 2600 and disk.num_dropped == 1
    assert disk.best(long_prompt(1, 20))[0] is None and disk.best(long_prompt(3, 20))[1] == 20
    disk.submit(saved(long_prompt(4, 20), 3000))  # larger than the budget: not written
    assert disk.flush() and len(disk) == 2
    disk.close()


def test_a_full_disk_leaves_no_half_entry_and_serving_goes_on(make_engine, tmp_path, caplog, monkeypatch):
    import errno
    import os

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    caplog.set_level(logging.WARNING, logger="app.engine.kv_tiers")
    disk = quick_disk(tmp_path, KEY, max_bytes=None)
    model = small_model()
    engine = make_engine(model, cache_ram_bytes=None, cache_disk=disk)
    first, _ = run(engine, long_prompt(1))
    wait_for(lambda: disk.num_failed_writes >= 1)
    assert "No space left on device" in caplog.text
    assert [p.name for p in disk.dir.iterdir()] == ["key.json"]  # neither an entry nor a temporary file
    assert not disk.holds(long_prompt(1))
    failures = disk.num_failed_writes
    again, cached = run(engine, long_prompt(1) + [5])  # the KV cache still serves it
    assert cached == 40 and again == FakeModel(n_ctx=64, n_batch=64, n_seq_max=2).expected_tokens(
        long_prompt(1) + [5], 4)
    engine.stop()  # persists what the disk lacks, on the engine thread: refused within the retry window
    assert disk.flush() and disk.num_failed_writes == failures and len(disk) == 0
    monkeypatch.undo()
    disk.close()


# -- privacy at rest: owner-only files, a maximum age, whose words an entry holds, private classes ---------------


class WallClock:
    """A wall clock that moves only when told to (the disk tier counts ages from the files' mtimes)."""

    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _mode(path) -> int:
    import os
    import stat

    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_disk_tier_s_folders_and_files_are_owner_only_whatever_the_umask(make_engine, tmp_path):
    import os

    old = os.umask(0o022)
    try:
        _, disk = first_session(make_engine, tmp_path / "kv")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "kv") == 0o700 and _mode(disk.dir) == 0o700
    assert _mode(only_file(disk)) == 0o600 and _mode(disk.dir / "key.json") == 0o600


def test_an_entry_written_open_by_an_older_hearth_is_made_owner_only_when_read(make_engine, tmp_path):
    import os

    _, disk = first_session(make_engine, tmp_path)
    os.chmod(only_file(disk), 0o644)
    quick_disk(tmp_path, dict(KEY), max_bytes=None).close()
    assert _mode(only_file(disk)) == 0o600


def test_an_entry_unused_for_the_maximum_age_is_deleted_on_access_and_at_start(tmp_path):
    clock = WallClock()
    disk = quick_disk(tmp_path, KEY, max_bytes=None, max_age_s=3600, clock=clock)
    disk.submit(saved(long_prompt(1, 20), 100))
    disk.submit(saved(long_prompt(2, 20), 100))
    assert disk.flush() and len(disk) == 2
    clock.now += 3000
    entry, n = disk.best(long_prompt(2, 20))
    assert n == 20 and disk.load(entry) is not None  # used now: its age starts again
    clock.now += 1000  # the first entry is 4,000 s unused, the second 1,000 s
    assert disk.best(long_prompt(1, 20)) == (None, 0)
    assert len(disk) == 1 and disk.num_expired == 1
    assert [p.name for p in disk.dir.iterdir() if p.suffix == ".kv"] == [disk.best(long_prompt(2, 20))[0].name]
    disk.close()
    clock.now += 3601
    restarted = quick_disk(tmp_path, KEY, max_bytes=None, max_age_s=3600, clock=clock)
    assert len(restarted) == 0 and not [p for p in restarted.dir.iterdir() if p.suffix == ".kv"]
    restarted.close()


def test_without_a_maximum_age_entries_stay(tmp_path):
    clock = WallClock()
    disk = quick_disk(tmp_path, KEY, max_bytes=None, clock=clock)
    disk.submit(saved(long_prompt(1, 20), 100))
    assert disk.flush()
    clock.now += 10 * 365 * 86400
    assert disk.best(long_prompt(1, 20))[1] == 20 and disk.expire() == 0
    disk.close()


def test_serve_s_job_expires_the_entries_of_models_no_runner_serves(tmp_path):
    from app.engine.kv_tiers import expire_entries
    from app.services.privacy import expire_kv_cache

    clock = WallClock()
    disk = quick_disk(tmp_path / "kv-cache", KEY, max_bytes=None, clock=clock)
    disk.submit(saved(long_prompt(1, 20), 100))
    assert disk.flush()
    disk.close()
    assert expire_kv_cache(tmp_path, lambda: 0, clock=lambda: clock.now + 10**9) == 0  # 0: never
    assert expire_entries(tmp_path / "kv-cache", 7200, clock.now + 7000) == 0
    assert expire_kv_cache(tmp_path, lambda: 2, clock=lambda: clock.now + 7201) == 1
    assert not [p for p in disk.dir.iterdir() if p.suffix == ".kv"]


def test_an_entry_knows_whose_words_it_holds_and_goes_with_its_member(make_engine, tmp_path):
    from app.engine.kv_tiers import entry_owner, remove_owner_entries

    disk = quick_disk(tmp_path, KEY, max_bytes=None)
    model = FakeModel(n_ctx=256, n_batch=64, n_seq_max=2, transfer_seq=TRANSFER)
    engine = make_engine(model, cache_ram_bytes=None, cache_disk=disk)
    for tag, owner in ((1, "alice"), (2, "bob"), (3, "alice/kid")):
        r = engine.submit(long_prompt(tag), greedy(4, ignore_eos=True), owner=owner)
        collect(r)
    wait_for(lambda: all(disk.holds(long_prompt(t)) for t in (1, 2, 3)))
    assert disk.flush()
    owners = {entry_owner(p) for p in disk.dir.iterdir() if p.suffix == ".kv"}
    assert owners == {"alice", "bob", "alice/kid"}
    assert remove_owner_entries(tmp_path, {"alice", "alice/kid"}.__contains__) == 2
    left = [p for p in disk.dir.iterdir() if p.suffix == ".kv"]
    assert [entry_owner(p) for p in left] == ["bob"]
    engine.stop()
    disk.close()


def test_a_private_class_s_prompt_is_never_written_to_disk_but_reused_from_memory(make_engine, tmp_path):
    disk = quick_disk(tmp_path, KEY, max_bytes=None)
    model = small_model()
    engine = make_engine(model, cache_ram_bytes=None, cache_disk=disk)
    r = engine.submit(long_prompt(1), greedy(4, ignore_eos=True), owner="alice", private=True)
    collect(r)
    # Another request, not private: once it is written, the writer has caught up with the idle engine.
    r2 = engine.submit(long_prompt(2), greedy(4, ignore_eos=True), owner="bob")
    collect(r2)  # its cells need the private entry's: evicted to the RAM tier, not to disk
    wait_for(lambda: disk.holds(long_prompt(2)))
    assert engine.tiers.counters.saves_total == 1 and len(engine.tiers.ram) == 1
    r3 = engine.submit(long_prompt(1) + [7], greedy(4, ignore_eos=True), owner="alice", private=True)
    _, fin = collect(r3)
    assert fin.stats.num_cached_tokens == 40 and engine.tiers.counters.hits_total == 1  # from RAM
    engine.stop()  # persists what the disk lacks: the private prompt stays out
    assert disk.flush()
    assert not disk.holds(long_prompt(1))
    files = [p for p in disk.dir.iterdir() if p.suffix == ".kv"]
    assert len(files) == 1 and disk.holds(long_prompt(2))
    disk.close()


def test_an_entry_serve_deleted_meanwhile_is_forgotten_without_a_warning(make_engine, tmp_path, caplog):
    first, disk = first_session(make_engine, tmp_path)
    disk2 = quick_disk(tmp_path, dict(KEY), max_bytes=None)
    only_file(disk2).unlink()  # serve's job, or a member's removal, while the runner runs
    caplog.set_level(logging.INFO, logger="app.engine.kv_tiers")
    engine = make_engine(small_model(), cache_ram_bytes=None, cache_disk=disk2)
    again, cached = run(engine, long_prompt(1))
    assert cached == 0 and again == first and disk2.num_bad == 0
    assert "was removed meanwhile" in caplog.text and "dropping" not in caplog.text
    engine.stop()
    disk2.close()


# -- a request alone gets the cache to itself, as llama-server's slot (issue 53) ------------------------------------

def test_a_request_alone_moves_the_other_prefixes_to_ram_and_reuses_even_a_short_one(make_engine):
    model = FakeModel(n_ctx=256, n_batch=64, n_seq_max=2, transfer_seq=TRANSFER)
    engine = make_engine(model, cache_ram_bytes=None)
    header = [5, 6, 7]  # a chat template's first line: shorter than MIN_MATCH_TOKENS
    a, b = header + long_prompt(1), header + long_prompt(2)
    run(engine, a)
    assert len(engine.scheduler.cache.entries) == 1
    out, cached = run(engine, b)
    # llama-server reuses any common prefix of its slot's last prompt: the header's cells, here too.
    assert cached == len(header)
    # a's entry left the KV cache for RAM, so b's new cells lie right after the header, as in llama-server's slot.
    assert engine.tiers.counters.saves_total == 1 and len(engine.tiers.ram) == 1
    assert len(engine.scheduler.cache.entries) == 1  # b's own, now
    assert out == FakeModel(n_ctx=256, n_batch=64, n_seq_max=2).expected_tokens(b, 4)
    # a comes back whole from RAM (its first cells too, not the header of b's entry).
    again, cached = run(engine, a)
    assert cached == len(a) - 1 and engine.tiers.counters.restored_tokens_total == len(a) - 1
    assert model.violations == [] and engine.scheduler.cache.check() == []


def test_without_a_ram_tier_the_cache_keeps_its_prefixes_and_its_minimum_match(make_engine):
    model = FakeModel(n_ctx=256, n_batch=64, n_seq_max=2)
    engine = make_engine(model, cache_ram_bytes=0)
    header = [5, 6, 7]
    run(engine, header + long_prompt(1))
    _, cached = run(engine, header + long_prompt(2))
    assert cached == 0 and len(engine.scheduler.cache.entries) == 2


def test_a_prefix_the_request_reuses_most_of_is_cut_back_not_copied_out(make_engine):
    model = FakeModel(n_ctx=256, n_batch=64, n_seq_max=2, transfer_seq=TRANSFER)
    engine = make_engine(model, cache_ram_bytes=None)
    prompt = long_prompt(1)
    run(engine, prompt)  # cached: the prompt and its 4 answer tokens
    _, cached = run(engine, prompt + [7, 8])  # a follow-up that shares the prompt, not the answer
    assert cached == len(prompt)
    # llama-server's slot overwrites its answer's cells; so does the runner: nothing is copied out for 4 tokens.
    assert engine.tiers.counters.saves_total == 0 and len(engine.tiers.ram) == 0
    # An unrelated prefix still goes to RAM, whole, when another request runs alone.
    run(engine, long_prompt(2))
    assert engine.tiers.counters.saves_total == 1 and engine.tiers.ram.items()[0].tokens[:len(prompt)] == prompt
    assert model.violations == [] and engine.scheduler.cache.check() == []
