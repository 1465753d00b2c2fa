"""The llama-batched-bench reference: parsing its real output, finding and running the binary."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from app import llama_tools
from app.devtools.reference import (
    BatchedBenchFailed,
    BatchedBenchNotFound,
    ReferenceRow,
    batched_bench_command,
    find_batched_bench,
    parse_batched_bench_output,
    run_batched_bench,
)

# Captured stdout of the llama-batched-bench built by scripts/build_llama_tools.sh from the
# llama-cpp-python 0.3.36 sdist, on Gemma 3 270M Q4_K_M with 2 threads (idle 2-core Xeon with AMX,
# so repacking off: see run_batched_bench):
#   llama-batched-bench --model gemma.gguf --ctx-size 4096 --batch-size 512 --ubatch-size 512 \
#     --threads 2 --threads-batch 2 --kv-unified -npp 16 -ntg 64 -npl 1,2,4,8 \
#     --output-format jsonl --swa-full --no-repack
JSONL_OUTPUT = """\
{"n_kv_max": 4096, "n_batch": 512, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 64, "pl": 1, "n_kv": 80, "t_pp": 0.036982, "speed_pp": 432.642914, "t_tg": 1.285942, "speed_tg": 49.768963, "t": 1.322924, "speed": 60.472111}
{"n_kv_max": 4096, "n_batch": 512, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 64, "pl": 2, "n_kv": 160, "t_pp": 0.060516, "speed_pp": 528.785767, "t_tg": 1.520253, "speed_tg": 84.196518, "t": 1.580769, "speed": 101.216560}
{"n_kv_max": 4096, "n_batch": 512, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 64, "pl": 4, "n_kv": 320, "t_pp": 0.102012, "speed_pp": 627.377136, "t_tg": 1.955318, "speed_tg": 130.925003, "t": 2.057330, "speed": 155.541412}
{"n_kv_max": 4096, "n_batch": 512, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 64, "pl": 8, "n_kv": 640, "t_pp": 0.181271, "speed_pp": 706.125061, "t_tg": 2.975571, "speed_tg": 172.067825, "t": 3.156842, "speed": 202.734253}

"""

# The same tool's default markdown output (no --output-format), -ntg 8 -npl 1,2.
MARKDOWN_OUTPUT = """
llama_batched_bench: n_kv_max = 4096, n_batch = 512, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |      8 |    1 |     24 |    0.037 |   437.21 |    0.144 |    55.63 |    0.180 |   133.03 |
|    16 |      8 |    2 |     48 |    0.057 |   565.73 |    0.187 |    85.70 |    0.243 |   197.31 |

"""

# What the tool writes to stderr, should a caller merge the two streams.
STDERR_NOISE = """\
0.00.504.806 W load: control-looking token:    212 '</s>' was not control-type; this is probably a bug in the model. its type will be overridden
0.00.620.540 W llama_kv_cache_iswa: using full-size SWA cache (ref: https://github.com/ggml-org/llama.cpp/pull/13194#issuecomment-2868343055)
"""


def test_parses_jsonl_rows_per_level():
    rows = parse_batched_bench_output(JSONL_OUTPUT)

    assert [row.n_parallel for row in rows] == [1, 2, 4, 8]
    assert rows[0] == ReferenceRow(
        n_parallel=1,
        prompt_tokens=16,
        gen_tokens=64,
        n_kv=80,
        prompt_time_s=0.036982,
        prompt_tokens_per_s=432.642914,
        decode_time_s=1.285942,
        decode_tokens_per_s=49.768963,
        total_time_s=1.322924,
        total_tokens_per_s=60.472111,
        n_ctx=4096,
        n_batch=512,
        n_ubatch=512,
        flash_attn=-1,
        is_pp_shared=False,
        n_gpu_layers=-1,
        n_threads=2,
        n_threads_batch=2,
    )
    assert [row.decode_tokens_per_s for row in rows] == [49.768963, 84.196518, 130.925003, 172.067825]


def test_jsonl_decode_rate_is_all_sequences_tokens_over_decode_time():
    for row in parse_batched_bench_output(JSONL_OUTPUT):
        expected = row.n_parallel * row.gen_tokens / row.decode_time_s
        assert row.decode_tokens_per_s == pytest.approx(expected, rel=1e-4)


def test_parses_markdown_table_with_its_settings_line():
    rows = parse_batched_bench_output(MARKDOWN_OUTPUT)

    assert len(rows) == 2
    second = rows[1]
    assert (second.n_parallel, second.prompt_tokens, second.gen_tokens, second.n_kv) == (2, 16, 8, 48)
    assert second.prompt_time_s == 0.057
    assert second.prompt_tokens_per_s == 565.73
    assert second.decode_time_s == 0.187
    assert second.decode_tokens_per_s == 85.70
    assert second.total_time_s == 0.243
    assert second.total_tokens_per_s == 197.31
    assert (second.n_ctx, second.n_batch, second.n_ubatch, second.n_threads) == (4096, 512, 512, 2)
    assert second.flash_attn == -1
    assert second.is_pp_shared is False


def test_markdown_without_settings_line_leaves_settings_unknown():
    table_only = "\n".join(line for line in MARKDOWN_OUTPUT.splitlines() if "n_kv_max" not in line)

    rows = parse_batched_bench_output(table_only)

    assert [row.n_parallel for row in rows] == [1, 2]
    assert rows[0].n_threads is None
    assert rows[0].is_pp_shared is None


def test_log_lines_around_the_results_are_ignored():
    assert parse_batched_bench_output(STDERR_NOISE + JSONL_OUTPUT) == parse_batched_bench_output(JSONL_OUTPUT)
    assert parse_batched_bench_output(STDERR_NOISE + MARKDOWN_OUTPUT) == parse_batched_bench_output(
        MARKDOWN_OUTPUT
    )


def test_jsonl_row_after_a_log_prefix_is_read():
    line = JSONL_OUTPUT.splitlines()[0]

    rows = parse_batched_bench_output(f"0.07.123.456 I {line}")

    assert rows[0].decode_tokens_per_s == 49.768963


def test_output_without_results_is_an_error():
    with pytest.raises(ValueError, match="no result rows"):
        parse_batched_bench_output(STDERR_NOISE)


def test_truncated_jsonl_row_is_an_error():
    line = JSONL_OUTPUT.splitlines()[0]

    with pytest.raises(ValueError, match="malformed"):
        parse_batched_bench_output(line[: line.index('"speed":')] + '"speed": inf}')


def test_command_asks_for_a_unified_cache_and_jsonl():
    command = batched_bench_command(
        "/bin/bench", "/m.gguf", n_ctx=4096, n_batch=512, threads=2, levels=[1, 2, 4, 8],
        prompt_tokens=16, gen_tokens=64, repack=False,
    )

    joined = " ".join(command)
    assert "--kv-unified" in command
    assert "--output-format jsonl" in joined
    assert "-npp 16 -ntg 64 -npl 1,2,4,8" in joined
    assert "--threads 2 --threads-batch 2" in joined
    assert "--no-repack" in command
    # Flash attention stays at llama.cpp's default (auto), like the engine's context.
    assert "--flash-attn" not in command and "-fa" not in command


def _make_executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_says_how_to_build_when_nothing_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("HEARTH_TOOLS_CACHE", str(tmp_path / "empty-cache"))

    with pytest.raises(BatchedBenchNotFound) as caught:
        find_batched_bench(None)

    message = str(caught.value)
    assert "scripts/build_llama_tools.sh" in message
    assert str(tmp_path / "empty-cache") in message


def test_find_rejects_a_missing_explicit_path(tmp_path):
    with pytest.raises(BatchedBenchNotFound, match="scripts/build_llama_tools.sh"):
        find_batched_bench(str(tmp_path / "nowhere" / "llama-batched-bench"))


def test_find_takes_an_explicit_executable(tmp_path):
    binary = _make_executable(tmp_path / "llama-batched-bench")

    assert find_batched_bench(str(binary)) == binary


def test_find_looks_in_the_versioned_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HEARTH_TOOLS_CACHE", str(tmp_path))
    version = llama_tools.pinned_llama_cpp_version()
    binary = _make_executable(tmp_path / version / "bin" / "llama-batched-bench")

    assert find_batched_bench(None) == binary


def test_pinned_version_matches_pyproject():
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"

    assert f'"llama-cpp-python=={llama_tools.pinned_llama_cpp_version()}"' in pyproject.read_text()


@pytest.fixture(scope="module")
def built_bench() -> Path:
    try:
        return find_batched_bench(os.environ.get("HEARTH_BATCHED_BENCH"))
    except BatchedBenchNotFound as exc:
        pytest.skip(str(exc))


def test_runs_the_built_binary_end_to_end(built_bench, gemma_path):
    # Repacking off: with it, this build segfaults on CPUs with AMX (the engine turns it off there
    # too); the test is about the run and the parse, not speed.
    rows = run_batched_bench(
        built_bench, gemma_path, n_ctx=512, n_batch=512, threads=2, levels=[1, 2],
        prompt_tokens=16, gen_tokens=8, timeout_s=300, repack=False,
    )

    assert [row.n_parallel for row in rows] == [1, 2]
    for row in rows:
        assert (row.prompt_tokens, row.gen_tokens) == (16, 8)
        assert row.n_kv == row.n_parallel * (16 + 8)
        assert row.decode_tokens_per_s > 0 and row.prompt_tokens_per_s > 0
        assert row.total_time_s == pytest.approx(row.prompt_time_s + row.decode_time_s, rel=1e-3)
        assert (row.n_ctx, row.n_threads, row.n_threads_batch) == (512, 2, 2)
        assert row.flash_attn == -1


def test_levels_that_do_not_fit_the_context_are_an_error(built_bench, gemma_path):
    # 16 sequences of 4 + 20 tokens need 384 cells; a 256-cell context only fits the first level.
    with pytest.raises(BatchedBenchFailed, match=r"skipped levels \[16\].*holds 256"):
        run_batched_bench(
            built_bench, gemma_path, n_ctx=256, n_batch=256, threads=2, levels=[1, 16],
            prompt_tokens=4, gen_tokens=20, timeout_s=300, repack=False,
        )
