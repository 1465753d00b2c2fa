"""Whether a llama.cpp build may repack weights on this CPU: asked of the build itself, once per build and CPU.

llama.cpp's CPU backend moves quantized weights into "extra buffer types" (repack), and on a CPU whose CPUID lists
AMX into AMX tiles. On an Intel Xeon VM whose CPUID lists amx_int8/amx_tile, whose XCR0 has the tile bits and whose
kernel grants ARCH_REQ_XCOMP_PERM, the pinned build still dies with SIGILL in tinygemm_kernel_amx at its first
decode: CPUID cannot tell. So the build is asked: a child process loads a tiny model with repack on, decodes a
prompt of 32 tokens (a batch wide enough for the AMX kernels) and 4 more one by one, and its exit decides. A signal
(SIGILL, SIGSEGV) means no; exit 0 means yes. The answer is cached per build (its library or binary: path, size,
mtime) and CPU (model name and flags) under ~/.cache/hearth/repack ($HEARTH_REPACK_CACHE; the image keeps it in
/data/cache/repack, which PUID owns), so a box probes once per build.

On a CPU without AMX no probe runs: repack paths without AMX were never seen to fail. `HEARTH_REPACK=on|off` sets the
answer by hand (a probe that cannot run, an admin who knows better). Hearth's runner, stock llama-server started as a
runner, the benches and the tests' oracles all take this one rule (app/devtools/stock_server.py for the last two).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from app.hardware import cpu_has_amx, cpu_model
from app.llama_tools import llama_lib_env, load_backends

log = logging.getLogger(__name__)

REPACK_ENV = "HEARTH_REPACK"
CACHE_ENV = "HEARTH_REPACK_CACHE"
_DEFAULT_CACHE = Path("~/.cache/hearth/repack")
# A load and 36 decodes of a 1-layer model take well under a second; a hung child must not hang a load.
PROBE_TIMEOUT_S = 60.0
PROMPT_TOKENS = 32
DECODE_TOKENS = 4
# The probe model: AMX's kernels take rows that are a multiple of 32 outputs and whole 256-value K-quant blocks.
_N_VOCAB, _N_EMBD, _N_FF, _N_HEAD = 512, 256, 512, 4

_memo: dict[str, bool] = {}


def repack_works(binary: str | os.PathLike | None = None, environ: dict[str, str] | None = None) -> bool:
    """Whether repack may be on: for `binary` (a stock llama-server) or, when None, the build Hearth's runners load."""
    env = dict(os.environ if environ is None else environ)
    forced = (env.get(REPACK_ENV) or "auto").strip().lower()
    if forced in ("on", "1", "true", "yes"):
        return True
    if forced in ("off", "0", "false", "no"):
        return False
    if not cpu_has_amx():
        return True
    key = _key(binary, env)
    if key in _memo:
        return _memo[key]
    cache = Path(env.get(CACHE_ENV) or _DEFAULT_CACHE).expanduser()
    answer = _cached_or_probe(cache, key, binary, env)
    _memo[key] = answer
    return answer


def _build_files(binary: str | os.PathLike | None, env: dict[str, str]) -> list[Path]:
    """The files whose change means another build: the binary, or the CPU libraries the runners load."""
    if binary is not None:
        return [Path(binary).resolve()]
    lib_dir = llama_lib_env(env).get("LLAMA_CPP_LIB_PATH")
    if lib_dir is None:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or not spec.submodule_search_locations:
            return []
        lib_dir = str(Path(next(iter(spec.submodule_search_locations))) / "lib")
    return sorted(p for p in Path(lib_dir).glob("lib*.so*") if "ggml" in p.name or "llama" in p.name)


def _cpu_identity() -> str:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{cpu_model()}|{flags}|{os.uname().release}"


def _key(binary: str | os.PathLike | None, env: dict[str, str]) -> str:
    parts = [_cpu_identity(), "server" if binary is not None else "runner"]
    for path in _build_files(binary, env):
        try:
            st = path.stat()
        except OSError:
            continue
        parts.append(f"{path}|{st.st_size}|{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _cached_or_probe(cache: Path, key: str, binary, env: dict[str, str]) -> bool:
    """The cached answer, else the probe's; one probe at a time per cache (parallel test workers, serve's loads)."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / ".lock", "a")  # noqa: SIM115 - held for the probe's length
    except OSError:
        lock = None  # a read-only home (a container's user): probe, keep the answer in memory only
    with lock or contextlib.nullcontext():
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        entry = cache / f"{key}.json"
        try:
            return bool(json.loads(entry.read_text())["repack"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        answer, why, definitive = probe(binary, env)
        level = logging.INFO if answer else logging.WARNING
        log.log(level, "repack %s for %s: %s", "on" if answer else "off", binary or "hearth's runners", why)
        if definitive and lock is not None:
            with contextlib.suppress(OSError):
                entry.write_text(json.dumps({"repack": answer, "why": why, "cpu": cpu_model(),
                                             "build": str(binary or "runner"), "at": time.time()}))
        return answer


def probe(binary: str | os.PathLike | None = None, environ: dict[str, str] | None = None) -> tuple[bool, str, bool]:
    """Run the probe now: (repack works, why, whether the answer is definitive enough to cache)."""
    env = dict(os.environ if environ is None else environ)
    with tempfile.TemporaryDirectory(prefix="hearth-repack-") as folder:
        model = Path(folder) / "probe.gguf"
        write_probe_model(model)
        if binary is None:
            return _probe_runner_build(model, env)
        return _probe_server(Path(binary), model, env)


def _verdict(returncode: int, what: str, tail: str) -> tuple[bool, str, bool]:
    if returncode == 0:
        return True, f"{what} decoded with repack on", True
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return False, f"{what} died with {name} with repack on", True
    return False, f"the probe could not run {what} (exit {returncode}): {tail[-300:].strip()}", False


def _probe_runner_build(model: Path, env: dict[str, str]) -> tuple[bool, str, bool]:
    child_env = {**env, **llama_lib_env(env)}
    try:
        done = subprocess.run([sys.executable, "-m", "app.repack", "--decode", str(model)], env=child_env,
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"the runners' llama.cpp build hung for {PROBE_TIMEOUT_S:.0f} s with repack on", False
    return _verdict(done.returncode, "the runners' llama.cpp build", done.stderr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe_server(binary: Path, model: Path, env: dict[str, str]) -> tuple[bool, str, bool]:
    """Stock llama-server with repack on: one completion of a 32-token prompt and 4 tokens, then stopped."""
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return False, f"{binary} is no executable file", False
    port = _free_port()
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "256", "-np", "1",
            "-t", "2", "-ngl", "0", "--repack", "--no-webui"]
    with tempfile.TemporaryFile() as out:
        # A session of its own: whatever it starts is stopped with it.
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return _ask_server(proc, port, binary.name, out)
        finally:
            _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the probe's server and its children, SIGKILL after 2 s (it holds nothing worth a longer drain)."""
    for sig, wait_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _ask_server(proc: subprocess.Popen, port: int, what: str, out) -> tuple[bool, str, bool]:
    def tail() -> str:
        out.seek(0)
        return out.read().decode(errors="replace")

    body = json.dumps({"prompt": list(range(3, 3 + PROMPT_TOKENS)), "n_predict": DECODE_TOKENS,
                       "temperature": 0, "cache_prompt": False}).encode()
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return _verdict(proc.returncode, what, tail())
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as health:
                ready = health.status == 200
        except (urllib.error.URLError, OSError):
            ready = False
        if not ready:
            time.sleep(0.05)
            continue
        request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S):
                pass
        except (urllib.error.URLError, OSError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            if proc.poll() is not None:
                return _verdict(proc.returncode, what, tail())
            return False, f"{what} did not answer the probe's completion: {tail()[-300:].strip()}", False
        return True, f"{what} decoded with repack on", True
    return False, f"{what} was not ready in {PROBE_TIMEOUT_S:.0f} s: {tail()[-300:].strip()}", False


def write_probe_model(path: str | os.PathLike) -> Path:
    """A 1-layer llama GGUF of random Q8_0/Q4_0 weights (about 1 MB): enough for every repack kernel to run."""
    import gguf
    from gguf.constants import GGMLQuantizationType as Q

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("hearth repack probe")
    w.add_context_length(256)
    w.add_embedding_length(_N_EMBD)
    w.add_block_count(1)
    w.add_feed_forward_length(_N_FF)
    w.add_head_count(_N_HEAD)
    w.add_head_count_kv(_N_HEAD)
    w.add_rope_dimension_count(_N_EMBD // _N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(_N_VOCAB)
    # A SentencePiece vocabulary of specials, the 256 byte tokens and filler pieces: it loads; ids are sent as is.
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(_N_VOCAB - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (_N_VOCAB - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * _N_VOCAB)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def weights(rows: int, cols: int, qtype: Q) -> np.ndarray:
        return gguf.quants.quantize(rng.normal(0, 0.02, (rows, cols)).astype(np.float32), qtype)

    tensors = [("token_embd.weight", weights(_N_VOCAB, _N_EMBD, Q.Q8_0), Q.Q8_0),
               ("output_norm.weight", np.ones(_N_EMBD, np.float32), Q.F32),
               ("output.weight", weights(_N_VOCAB, _N_EMBD, Q.Q8_0), Q.Q8_0),
               ("blk.0.attn_norm.weight", np.ones(_N_EMBD, np.float32), Q.F32),
               ("blk.0.ffn_norm.weight", np.ones(_N_EMBD, np.float32), Q.F32)]
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        tensors.append((f"blk.0.{name}.weight", weights(_N_EMBD, _N_EMBD, Q.Q8_0), Q.Q8_0))
    tensors.append(("blk.0.ffn_gate.weight", weights(_N_FF, _N_EMBD, Q.Q4_0), Q.Q4_0))
    tensors.append(("blk.0.ffn_up.weight", weights(_N_FF, _N_EMBD, Q.Q4_0), Q.Q4_0))
    tensors.append(("blk.0.ffn_down.weight", weights(_N_EMBD, _N_FF, Q.Q4_0), Q.Q4_0))
    for name, data, qtype in tensors:
        w.add_tensor(name, data, raw_dtype=qtype if qtype != Q.F32 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _decode(model_path: str, repack: bool = True) -> int:
    """The probe's child: load (repack on), decode a 32-token prompt and 4 tokens; 0 when all of it ran."""
    import llama_cpp

    load_backends()
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = repack
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
    if not model:
        print("the probe model did not load", file=sys.stderr)
        return 2
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_threads, cparams.n_threads_batch = 256, 64, 2, 2
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    batch = llama_cpp.llama_batch_init(64, 0, 1)
    try:
        position = 0
        for width in (PROMPT_TOKENS, *([1] * DECODE_TOKENS)):
            batch.n_tokens = width
            for i in range(width):
                batch.token[i] = 3 + (position + i) % (_N_VOCAB - 3)
                batch.pos[i] = position + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == width - 1
            if llama_cpp.llama_decode(ctx, batch) != 0:
                print("llama_decode failed", file=sys.stderr)
                return 3
            position += width
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m app.repack`: print the rule's answer (or, with --decode MODEL, be the probe's child)."""
    parser = argparse.ArgumentParser(prog="python -m app.repack", description=__doc__.splitlines()[0])
    parser.add_argument("--decode", metavar="MODEL", help="the probe's child: decode MODEL with repack on")
    parser.add_argument("--plain", action="store_true", help="with --decode: repack off (the probe's control)")
    parser.add_argument("--llama-server", metavar="BIN", help="ask about this stock llama-server build")
    parser.add_argument("--fresh", action="store_true", help="probe now, ignoring the cache")
    args = parser.parse_args(argv)
    if args.decode:
        return _decode(args.decode, repack=not args.plain)
    if args.fresh:
        works, why, _ = probe(args.llama_server)
    else:
        works, why = repack_works(args.llama_server), "cached or probed (see --fresh)"
    print(json.dumps({"repack": works, "why": why, "cpu": cpu_model(), "amx": cpu_has_amx()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
