"""Speculative decoding on the runner's command line: --spec-type per model setting and runner kind, and the
draft rows it reserves counted in the memory estimate."""

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.engine.kv_tiers import DEFAULT_CACHE_RAM_MIB
from app.engine.speculation import LOOKUP_DRAFT_MAX, NGRAM_TYPES
from app.residency.catalog import CatalogEntry
from app.residency.estimate import FLOAT32_BYTES, estimate_memory, size_runner
from app.residency.runner_spec import SPECULATION_SETTINGS, RunnerSpec, spec_type_for, speculation_problem
from app.services.catalog import runner_sizing, runner_spec

MIB = 1024 * 1024
DEFAULTS = {"ctx": 4096, "parallel": 4, "batch": 512, "threads": 2, "prefix_cache": True, "args": None}
STOCK = "/opt/llama/bin/llama-server"


def entry(**changes) -> CatalogEntry:
    """A usable model with a large vocabulary (whose logit rows are what drafting adds)."""
    e = CatalogEntry(
        name="gemma", path=Path("/models/gemma.gguf"), source="folder", size_bytes=300 * MIB, mtime=0.0,
        usable=True, architecture="gemma3", n_params=270_000_000, weights_bytes=240 * MIB, quantization="Q4_K_M",
        n_ctx_train=32768, n_layers=18, n_embd=640, n_ff=2048, n_head=4, n_head_kv=1, head_dim_k=256,
        head_dim_v=256, n_vocab=262144,
    )
    return replace(e, **changes)


def settings(kind="hearth", speculation=None, **fields):
    """A model's runner_settings row as runner_spec reads it."""
    row = dict(kind=kind, binary_path=STOCK if kind == "llama-server" else None, n_ctx=None, parallel=None,
               n_batch=None, threads=None, gpu_layers=None, mode=None, speculation=speculation, cache_type_k=None,
               cache_type_v=None, n_cpu_moe=None, devices=None, tensor_split=None, split_mode=None, main_gpu=None)
    return SimpleNamespace(**{**row, **fields})


def spec_args(cmd: list[str]) -> list[str]:
    """The --spec-type flag and its value, wherever they are on the command line."""
    return [a for i, a in enumerate(cmd) if a == "--spec-type" or (i and cmd[i - 1] == "--spec-type")]


@pytest.mark.parametrize("setting, hearth, stock", [
    (None, "ngram-lookup", None),
    ("auto", "ngram-lookup", None),
    ("off", "none", "none"),
    ("ngram-lookup", "ngram-lookup", None),
    ("ngram-simple", "ngram-simple", "ngram-simple"),
    ("ngram-map-k", "ngram-map-k", "ngram-map-k"),
    ("ngram-map-k4v", "ngram-map-k4v", "ngram-map-k4v"),
    ("ngram-mod", "ngram-mod", "ngram-mod"),
])
def test_each_setting_gives_each_kind_its_spec_type(setting, hearth, stock):
    assert spec_type_for("hearth", setting) == hearth
    assert spec_type_for("llama-server", setting) == stock
    cmd = runner_spec(entry(), settings(speculation=setting), DEFAULTS).command(8081)
    assert spec_args(cmd) == ["--spec-type", hearth]
    stock_cmd = runner_spec(entry(), settings("llama-server", setting), DEFAULTS).command(8081)
    # auto leaves llama-server's own default (it has no ngram-lookup): no flag at all.
    assert spec_args(stock_cmd) == ([] if stock is None else ["--spec-type", stock])


def test_every_setting_is_covered_and_an_unknown_one_is_refused():
    assert SPECULATION_SETTINGS == ("auto", "off", *NGRAM_TYPES)
    with pytest.raises(ValueError, match="unknown speculation setting 'eagle'"):
        spec_type_for("hearth", "eagle")
    assert speculation_problem("hearth", "ngram-lookup") is None
    assert "Hearth's own" in speculation_problem("llama-server", "ngram-lookup")
    assert speculation_problem("llama-server", "ngram-mod") is None
    assert "choose one of" in speculation_problem("hearth", "draft-simple")


def test_a_model_without_runner_settings_drafts_by_load_with_ngram_lookup():
    spec = runner_spec(entry(), None, DEFAULTS)
    assert spec.spec_type == "ngram-lookup"
    assert spec_args(spec.command(8081)) == ["--spec-type", "ngram-lookup"]
    assert spec.n_outputs_extra == LOOKUP_DRAFT_MAX


def test_runner_args_naming_the_type_win_and_keep_the_flag_single():
    defaults = {**DEFAULTS, "args": '{"gemma": ["--spec-type=ngram-mod", "--spec-draft-n-max", "8"]}'}
    spec = runner_spec(entry(), settings(speculation="off"), defaults)
    cmd = spec.command(8081)
    assert sum(a.startswith("--spec-type") for a in cmd) == 1 and cmd[-3:] == ["--spec-type=ngram-mod",
                                                                               "--spec-draft-n-max", "8"]
    assert spec.effective_spec_type == "ngram-mod" and spec.n_outputs_extra == 8


def test_only_a_drafting_hearth_runner_reserves_draft_rows():
    assert RunnerSpec("m", "/m.gguf", spec_type="none").n_outputs_extra == 0
    assert RunnerSpec("m", "/m.gguf").n_outputs_extra == 0  # no flag: the runner's default is none
    assert RunnerSpec("m", "/m.gguf", spec_type="ngram-mod").n_outputs_extra == 64
    assert RunnerSpec("m", "/m.gguf", spec_type="ngram-simple").n_outputs_extra == 48
    stock = RunnerSpec("m", "/m.gguf", kind="llama-server", binary_path=STOCK, spec_type="ngram-mod")
    assert stock.n_outputs_extra == 0


def test_the_estimate_counts_the_draft_rows_twice_at_most_and_once_at_least():
    e = entry()
    row = e.n_vocab * FLOAT32_BYTES
    plain = estimate_memory(e, 4096, 4, 512)
    drafting = estimate_memory(e, 4096, 4, 512, n_outputs_extra=LOOKUP_DRAFT_MAX)
    added = drafting.total_bytes - plain.total_bytes
    # The host output buffer takes every row; the compute buffer's logits phase too when it is the larger phase.
    assert LOOKUP_DRAFT_MAX * row <= added <= 2 * LOOKUP_DRAFT_MAX * row
    assert drafting.compute_bytes - plain.compute_bytes == added
    with pytest.raises(ValueError, match="n_outputs_extra"):
        estimate_memory(e, 4096, 4, 512, n_outputs_extra=-1)


def test_the_catalog_estimate_and_sizing_follow_the_setting():
    e = entry()
    on = runner_spec(e, settings(n_ctx=4096, parallel=4), DEFAULTS)
    off = runner_spec(e, settings(speculation="off", n_ctx=4096, parallel=4), DEFAULTS)
    assert (on.n_outputs_extra, off.n_outputs_extra) == (LOOKUP_DRAFT_MAX, 0)
    est_on = estimate_memory(e, 4096, 4, 512, n_outputs_extra=on.n_outputs_extra).total_bytes
    est_off = estimate_memory(e, 4096, 4, 512, n_outputs_extra=off.n_outputs_extra).total_bytes
    assert est_on > est_off
    # Sizing from the budget (no slots or cells set) reserves the same rows.
    auto = {**DEFAULTS, "ctx": None, "parallel": None}
    budget = 4 * 1024 * MIB
    sized = runner_sizing(e, settings(), auto, budget)
    # (and the RAM tier's default budget: no cache_ram_mib among these defaults)
    assert sized.estimate_bytes == size_runner(e, budget, 512, n_outputs_extra=LOOKUP_DRAFT_MAX,
                                               ram_tier_mib=DEFAULT_CACHE_RAM_MIB).estimate_bytes
    assert sized.estimate_bytes > runner_sizing(e, settings(speculation="off"), auto, budget).estimate_bytes
