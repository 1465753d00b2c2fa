"""The RAM tier's budget in a runner's footprint: the estimate, the memory budget, the catalog and the Models page.

The tier is host RAM a runner fills with prompt KV evicted from its KV cache (--cache-ram); a RAM budget reserves
all of it, a VRAM budget none, and a load's measured RSS is checked against the estimate without it (the tier
starts empty).
"""

from pathlib import Path
from types import SimpleNamespace

import pytest

from app.engine.kv_tiers import DEFAULT_CACHE_RAM_MIB
from app.residency.budget import KIND_RAM, KIND_VRAM, counted_bytes
from app.residency.catalog import CatalogEntry, scan
from app.residency.estimate import MIB, estimate_memory, size_runner
from app.residency.runner_spec import LLAMA_SERVER_CACHE_RAM_MIB, RunnerSpec
from app.services.catalog import Catalog
from app.services.settings import SettingsCache
from app.store.db import open_store
from app.store.settings import Invalid, set_setting, validate


def gemma() -> CatalogEntry:
    """A usable entry with Gemma 3 270M's header facts (no file needed)."""
    return CatalogEntry("gemma", Path("/models/gemma.gguf"), "folder", 253 * MIB, 0.0, True, weights_bytes=235 * MIB,
                        n_layers=18, n_head_kv=1, head_dim_k=256, head_dim_v=256, n_embd=640, n_ff=2048,
                        n_vocab=262144, n_swa=512, n_ctx_train=32768)


def test_the_estimate_counts_the_ram_tier_s_budget_whole_and_a_load_without_it():
    e = gemma()
    plain = estimate_memory(e, 4096, 4)
    tier = estimate_memory(e, 4096, 4, ram_tier_mib=512)
    assert tier.ram_tier_bytes == 512 * MIB and tier.total_bytes == plain.total_bytes + 512 * MIB
    assert tier.at_load_bytes == plain.total_bytes == plain.at_load_bytes
    unbounded = estimate_memory(e, 4096, 4, ram_tier_mib=-1)
    assert unbounded.ram_tier_unbounded and unbounded.ram_tier_bytes == 0
    with pytest.raises(ValueError, match=r"ram_tier_mib must be -1 \(no limit\), 0 \(none\) or a size in MiB"):
        estimate_memory(e, 4096, 4, ram_tier_mib=-2)


def test_a_ram_budget_reserves_the_tier_and_a_vram_budget_does_not():
    est = estimate_memory(gemma(), 4096, 4, ram_tier_mib=1024)
    assert counted_bytes(est, KIND_RAM) == est.total_bytes
    assert counted_bytes(est, KIND_VRAM) == est.total_bytes - 1024 * MIB


def test_sizing_counts_the_tier_in_a_model_s_share_but_never_trades_slots_for_it():
    e = gemma()
    budget = 8 * 1024 * MIB
    without = size_runner(e, budget)
    with_tier = size_runner(e, budget, ram_tier_mib=512)
    assert with_tier.parallel == without.parallel == 8
    assert with_tier.estimate_bytes == without.estimate_bytes + 512 * MIB
    # A tier as large as the budget: the slots stay; the catalog gives the tier what is left (fit_ram_tier).
    small = 2 * 1024 * MIB
    assert size_runner(e, small, ram_tier_mib=2048).parallel == size_runner(e, small).parallel


@pytest.mark.parametrize("spec, mib", [
    (RunnerSpec("m", "/m.gguf", cache_ram_mib=300), 300),
    (RunnerSpec("m", "/m.gguf", cache_ram_mib=300, prefix_cache=False), 0),  # no cache entries, no tier
    (RunnerSpec("m", "/m.gguf", cache_ram_mib=300, extra_args=("--cache-ram", "64")), 64),  # runner_args win
    (RunnerSpec("m", "/m.gguf", cache_ram_mib=300, extra_args=("-cram=-1",)), -1),
    (RunnerSpec("m", "/m.gguf", kind="llama-server", binary_path="/bin/llama-server"), LLAMA_SERVER_CACHE_RAM_MIB),
    (RunnerSpec("m", "/m.gguf", kind="llama-server", binary_path="/bin/llama-server", extra_args=("-cram", "0")), 0),
])
def test_the_tier_a_runner_gets_is_the_one_its_command_line_gives_it(spec, mib):
    assert spec.ram_tier_mib == mib


@pytest.fixture
def store(tmp_path):
    data = tmp_path / "data"
    engine, sessions = open_store(data)
    yield data, sessions
    engine.dispose()


def put(sessions, name, value):
    with sessions() as s:
        set_setting(s, name, validate(name, value))
        s.commit()


def test_a_changed_ram_budget_applies_to_the_runners_started_after_it(store, gemma_path, monkeypatch):
    from app.residency import budget as budget_mod

    data, sessions = store
    # A RAM box (no GPU found), as this test machine is; the budget itself is the setting's.
    monkeypatch.setattr(budget_mod, "gpu_memory", lambda nvml=None: ([], "no NVIDIA driver"))
    put(sessions, "memory_limit_mb", "8192")
    put(sessions, "runner_ctx", "1024")
    put(sessions, "runner_parallel", "2")
    catalog = Catalog.open(data, sessions, SettingsCache(sessions), default_model=gemma_path)
    name = catalog.entries[0].name
    entry = scan(None, gemma_path)[0]
    first = catalog.model_specs()[name]
    assert first.runner.cache_ram_mib == DEFAULT_CACHE_RAM_MIB
    r = first.runner
    assert first.estimate_bytes == estimate_memory(entry, r.n_ctx, r.parallel, r.n_batch, n_outputs_extra=r.n_outputs_extra,
                                                   ram_tier_mib=DEFAULT_CACHE_RAM_MIB).total_bytes
    put(sessions, "runner_cache_ram_mib", "256")
    catalog.rescan()  # serve's rescan_catalog job
    spec = catalog.model_specs()[name]
    cmd = spec.runner.command(8081)
    assert cmd[cmd.index("--cache-ram") + 1] == "256"
    assert first.estimate_bytes - spec.estimate_bytes == (DEFAULT_CACHE_RAM_MIB - 256) * MIB
    assert spec.sizing_note is None  # 256 MiB fit: nothing to say


def test_a_tier_larger_than_the_budget_leaves_gets_what_is_left_and_the_model_still_loads(store, gemma_path,
                                                                                         monkeypatch):
    from app.residency import budget as budget_mod

    data, sessions = store
    monkeypatch.setattr(budget_mod, "gpu_memory", lambda nvml=None: ([], "no NVIDIA driver"))
    put(sessions, "runner_ctx", "1024")
    put(sessions, "runner_parallel", "2")
    put(sessions, "memory_limit_mb", "1024")  # the model takes ~500 MiB: the 2 GiB default tier cannot fit
    catalog = Catalog.open(data, sessions, SettingsCache(sessions), default_model=gemma_path)
    spec = catalog.model_specs()[catalog.entries[0].name]
    at_load = spec.estimate_bytes - spec.runner.cache_ram_mib * MIB
    assert 0 < spec.runner.cache_ram_mib < DEFAULT_CACHE_RAM_MIB
    assert spec.runner.cache_ram_mib == (1024 * MIB - at_load) // MIB
    assert spec.estimate_bytes <= 1024 * MIB
    cmd = spec.runner.command(8081)
    assert cmd[cmd.index("--cache-ram") + 1] == str(spec.runner.cache_ram_mib)
    assert f"RAM tier {spec.runner.cache_ram_mib:,} MiB instead of runner_cache_ram_mib's 2,048 MiB" in spec.sizing_note
    # A VRAM budget would not reserve the tier at all: nothing to fit.
    monkeypatch.setattr(budget_mod, "gpu_memory", lambda nvml=None: (
        [SimpleNamespace(name="GPU", total_bytes=1024 * MIB, free_bytes=1024 * MIB)], "NVML"))
    catalog.rescan()
    spec = catalog.model_specs()[catalog.entries[0].name]
    assert spec.runner.cache_ram_mib == DEFAULT_CACHE_RAM_MIB and spec.sizing_note is None


@pytest.mark.parametrize("name, raw, words", [
    ("runner_cache_ram_mib", "-2", "runner_cache_ram_mib must be at least -1 (-1: no limit, 0: off) (got -2)"),
    ("runner_cache_ram_mib", "2000000", "runner_cache_ram_mib must be at most 1048576 (-1: no limit, 0: off)"),
    ("runner_cache_disk_mib", "-5", "runner_cache_disk_mib must be at least -1 (-1: no limit, 0: off) (got -5)"),
    ("runner_cache_ram_mib", "1.5", "runner_cache_ram_mib"),
])
def test_an_out_of_bounds_budget_is_refused_with_what_the_values_mean(name, raw, words):
    with pytest.raises(Invalid) as exc:
        validate(name, raw)
    assert words in str(exc.value)


def test_the_budgets_in_bounds_are_kept():
    assert validate("runner_cache_ram_mib", "-1") == -1
    assert validate("runner_cache_ram_mib", "0") == 0
    assert validate("runner_cache_disk_mib", "10240") == 10240


def test_a_pull_is_refused_when_the_ram_tier_leaves_no_room_and_the_message_says_which_setting(gemma_path):
    from app.gguf_meta import read_metadata
    from app.residency.library import budget_refusal

    meta = read_metadata(gemma_path)
    entry = scan(None, gemma_path)[0]
    alone = estimate_memory(entry, 1024, 2).total_bytes
    budget = alone + 100 * MIB
    assert budget_refusal(meta, 1024, 2, 512, budget) is None
    refusal = budget_refusal(meta, 1024, 2, 512, budget, ram_tier_mib=512)
    assert refusal is not None and "RAM tier 512 MiB" in refusal and "lower runner_cache_ram_mib" in refusal
