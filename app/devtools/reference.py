"""The physical reference: llama.cpp's own C++ batched decoding (`llama-batched-bench`), run and parsed."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.llama_tools import BUILD_SCRIPT, LlamaToolsNotFound, tools_cache_dir

BATCHED_BENCH = "llama-batched-bench"


# The settings line printed above the markdown table, e.g.
# "llama_batched_bench: n_kv_max = 2048, n_batch = 2048, n_ubatch = 512, flash_attn = -1, ..."
_SETTING = re.compile(r"(\w+) = (-?\d+)")

# Environment variables that llama.cpp's argument parser and logger read: scrubbed so the flags
# passed below are the whole configuration, whatever the caller's shell exports.
_LLAMA_ENV_PREFIXES = ("LLAMA_ARG_", "LLAMA_LOG_")


class BatchedBenchNotFound(LlamaToolsNotFound):
    """No runnable llama-batched-bench where one was looked for."""


class BatchedBenchFailed(RuntimeError):
    """llama-batched-bench exited with an error, timed out or printed no results."""


@dataclass(frozen=True)
class ReferenceRow:
    """One concurrency level of llama-batched-bench: what ran and how fast."""

    n_parallel: int  # B: sequences decoded together
    prompt_tokens: int  # PP: prompt tokens per sequence
    gen_tokens: int  # TG: generated tokens per sequence
    n_kv: int  # KV cells the level needs
    prompt_time_s: float  # T_PP: all prompts processed
    prompt_tokens_per_s: float  # S_PP
    decode_time_s: float  # T_TG: all sequences generated
    decode_tokens_per_s: float  # S_TG: n_parallel * gen_tokens / decode_time_s
    total_time_s: float  # T
    total_tokens_per_s: float  # S
    # What the tool held constant, as it reports it (None when the output did not say).
    n_ctx: int | None = None  # n_kv_max
    n_batch: int | None = None
    n_ubatch: int | None = None
    flash_attn: int | None = None  # the requested type: -1 auto, 0 off, 1 on
    is_pp_shared: bool | None = None
    n_gpu_layers: int | None = None
    n_threads: int | None = None
    n_threads_batch: int | None = None


def find_batched_bench(explicit: str | None) -> Path:
    """Path to llama-batched-bench: the explicit one if given, else the build script's cache."""
    if explicit:
        path = Path(explicit).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise BatchedBenchNotFound(
            f"{path} is not an executable {BATCHED_BENCH}; pass the binary's path, or build it "
            f"with {BUILD_SCRIPT}"
        )
    path = tools_cache_dir() / "bin" / BATCHED_BENCH
    if path.is_file() and os.access(path, os.X_OK):
        return path
    raise BatchedBenchNotFound(
        f"{BATCHED_BENCH} is not built: looked for {path}. Run {BUILD_SCRIPT} (a few minutes on a "
        f"small CPU; CMAKE_ARGS=-DGGML_CUDA=ON for a GPU build), or pass the binary's path"
    )


def batched_bench_command(
    binary: str | Path,
    model_path: str | Path,
    n_ctx: int,
    n_batch: int,
    threads: int,
    levels: Sequence[int],
    prompt_tokens: int,
    gen_tokens: int,
    *,
    n_ubatch: int | None = None,
    swa_full: bool = True,
    gpu_layers: int | None = None,
    repack: bool | None = None,
) -> list[str]:
    """The llama-batched-bench command line for one reference run."""
    command = [
        str(binary),
        "--model", str(model_path),
        "--ctx-size", str(n_ctx),
        "--batch-size", str(n_batch),
        # llama.cpp's default micro-batch (512), capped by the batch as the engine caps it.
        "--ubatch-size", str(n_ubatch if n_ubatch is not None else min(n_batch, 512)),
        # Prompt and decode threads alike, as the engine sets n_threads and n_threads_batch.
        "--threads", str(threads),
        "--threads-batch", str(threads),
        # One KV buffer shared by all sequences, the layout a continuous-batching server uses;
        # without it each of the n_parallel sequences gets a fixed n_ctx / n_parallel slice.
        "--kv-unified",
        "-npp", str(prompt_tokens),
        "-ntg", str(gen_tokens),
        "-npl", ",".join(str(level) for level in levels),
        # Machine-readable rows (this version has it) instead of the markdown table.
        "--output-format", "jsonl",
    ]
    # Flash attention is left at its default, which is 'auto' in both common_params (this tool)
    # and llama_context_default_params() (the engine): llama.cpp enables it when the backend
    # supports the op for the model's layers, so both sides resolve it the same way.
    #
    # SWA cache: llama_context_default_params() has swa_full = true but common_params (this tool)
    # has false, so the engine's default is asked for explicitly; it only changes the size of the
    # sliding-window layers' cache, which matters once sequences outgrow the window.
    if swa_full:
        command.append("--swa-full")
    if gpu_layers is not None:
        command += ["--gpu-layers", str(gpu_layers)]
    # Weight repacking ("extra buffer types"): None keeps llama.cpp's default (on). The engine
    # turns it off on CPUs with AMX, where this build's repacked path segfaults in decode, and the
    # caller should pass the engine's choice so both sides run the same kernels.
    if repack is not None:
        command.append("--repack" if repack else "--no-repack")
    return command


def run_batched_bench(
    binary: str | Path,
    model_path: str | Path,
    n_ctx: int,
    n_batch: int,
    threads: int,
    levels: list[int],
    prompt_tokens: int,
    gen_tokens: int,
    timeout_s: float,
    *,
    n_ubatch: int | None = None,
    swa_full: bool = True,
    gpu_layers: int | None = None,
    repack: bool | None = None,
) -> list[ReferenceRow]:
    """Run llama-batched-bench on the model and return one row per concurrency level."""
    command = batched_bench_command(
        binary, model_path, n_ctx, n_batch, threads, levels, prompt_tokens, gen_tokens,
        n_ubatch=n_ubatch, swa_full=swa_full, gpu_layers=gpu_layers, repack=repack,
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith(_LLAMA_ENV_PREFIXES)}
    try:
        completed = subprocess.run(
            command, capture_output=True, text=True, errors="replace", env=env,
            timeout=timeout_s, check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise BatchedBenchFailed(f"{BATCHED_BENCH} ran past {timeout_s} s: {' '.join(command)}") from exc
    if completed.returncode != 0:
        hint = ""
        if completed.returncode < 0 and repack is not False:
            hint = " (on CPUs with AMX this build crashes with weight repacking on: pass repack=False)"
        raise BatchedBenchFailed(
            f"{BATCHED_BENCH} exited with status {completed.returncode}{hint}: {' '.join(command)}\n"
            f"{_tail(completed.stderr)}"
        )
    try:
        rows = parse_batched_bench_output(completed.stdout)
    except ValueError as exc:
        raise BatchedBenchFailed(
            f"{exc} (a level runs only if n_parallel * ({prompt_tokens} + {gen_tokens}) KV cells fit "
            f"the context of {n_ctx}): {' '.join(command)}\n{_tail(completed.stderr)}"
        ) from exc
    # The tool silently skips a level whose sequences do not fit the context.
    missing = sorted(set(levels) - {row.n_parallel for row in rows})
    if missing:
        # llama.cpp rounds the context up (to a multiple of 256), so report the size it used.
        n_kv_max = rows[0].n_ctx or n_ctx
        raise BatchedBenchFailed(
            f"{BATCHED_BENCH} skipped levels {missing}: each needs n_parallel * "
            f"({prompt_tokens} + {gen_tokens}) KV cells but the context holds {n_kv_max}"
        )
    return rows


def parse_batched_bench_output(text: str) -> list[ReferenceRow]:
    """Rows from llama-batched-bench's output, either JSON lines or the markdown table."""
    rows: list[ReferenceRow] = []
    settings: dict[str, int] = {}
    for line in text.splitlines():
        # A JSON row may follow a log prefix (--log-prefix, timestamps), so start at the brace;
        # only lines naming a result field count, so braces in stray log lines are ignored.
        brace = line.find("{")
        if brace >= 0 and '"speed_tg"' in line:
            rows.append(_row_from_json(line[brace:]))
            continue
        if "n_kv_max =" in line:
            settings = {key: int(value) for key, value in _SETTING.findall(line)}
            continue
        row = _row_from_table(line, settings)
        if row is not None:
            rows.append(row)
    if not rows:
        raise ValueError(f"no result rows in {BATCHED_BENCH} output")
    return rows


def _row_from_json(line: str) -> ReferenceRow:
    try:
        record = json.loads(line)
        return ReferenceRow(
            n_parallel=int(record["pl"]),
            prompt_tokens=int(record["pp"]),
            gen_tokens=int(record["tg"]),
            n_kv=int(record["n_kv"]),
            prompt_time_s=float(record["t_pp"]),
            prompt_tokens_per_s=float(record["speed_pp"]),
            decode_time_s=float(record["t_tg"]),
            decode_tokens_per_s=float(record["speed_tg"]),
            total_time_s=float(record["t"]),
            total_tokens_per_s=float(record["speed"]),
            n_ctx=int(record["n_kv_max"]),
            n_batch=int(record["n_batch"]),
            n_ubatch=int(record["n_ubatch"]),
            flash_attn=int(record["flash_attn"]),
            is_pp_shared=bool(record["is_pp_shared"]),
            n_gpu_layers=int(record["n_gpu_layers"]),
            n_threads=int(record["n_threads"]),
            n_threads_batch=int(record["n_threads_batch"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        # json.JSONDecodeError is a ValueError; a printed "inf" or "nan" speed lands here too.
        raise ValueError(f"malformed {BATCHED_BENCH} JSON row: {line!r}") from exc


def _row_from_table(line: str, settings: dict[str, int]) -> ReferenceRow | None:
    # Data rows look like "|    16 |     64 |    1 |     80 |    0.051 |  313.73 | ...": ten cells,
    # the first four integers. The heading and the dashed rule fail the integer test.
    stripped = line.strip()
    if not stripped.startswith("|"):
        return None
    cells = [cell.strip() for cell in stripped.strip("|").split("|")]
    if len(cells) != 10:
        return None
    try:
        counts = [int(cell) for cell in cells[:4]]
        figures = [float(cell) for cell in cells[4:]]
    except ValueError:
        return None
    pp, tg, pl, n_kv = counts
    t_pp, s_pp, t_tg, s_tg, t, s = figures
    is_pp_shared = settings.get("is_pp_shared")
    return ReferenceRow(
        n_parallel=pl,
        prompt_tokens=pp,
        gen_tokens=tg,
        n_kv=n_kv,
        prompt_time_s=t_pp,
        prompt_tokens_per_s=s_pp,
        decode_time_s=t_tg,
        decode_tokens_per_s=s_tg,
        total_time_s=t,
        total_tokens_per_s=s,
        n_ctx=settings.get("n_kv_max"),
        n_batch=settings.get("n_batch"),
        n_ubatch=settings.get("n_ubatch"),
        flash_attn=settings.get("flash_attn"),
        is_pp_shared=None if is_pp_shared is None else bool(is_pp_shared),
        n_gpu_layers=settings.get("n_gpu_layers"),
        n_threads=settings.get("n_threads"),
        n_threads_batch=settings.get("n_threads_batch"),
    )


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
