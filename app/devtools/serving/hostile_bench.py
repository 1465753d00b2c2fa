"""`hearth bench hostile`: the worst bodies of at most 64 KiB that the bounds still accept, and what they cost.

Target (issue 27): no request of ≤ 64 KiB makes a runner use more than 200 MB extra or 2 s of
compile time. For each bound, the body searched for is the largest one of its family that is still
accepted (door checks, conversion and its budget), within 64 KiB. Each is measured twice:

  in process   door validation + conversion (cold caches), then llama.cpp's grammar parse on the
               model's vocabulary, with this process's peak RSS growth over the parse;
  on a runner  the body sent to a real `hearth runner` (max_tokens 4): the answer's time and the
               runner's peak RSS growth over the request (VmHWM, reset before each).

A few refused bodies (the issue's 150-byte response_format among them) are sent too: they must
cost nothing. The table ends with the worst figures against the target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import psutil

from app.devtools.processes import stop_process
from app.llama_tools import load_backends
from app.residency.supervisor import free_port

MAX_BODY_BYTES = 64 * 1024
TARGET_COMPILE_S = 2.0
TARGET_EXTRA_BYTES = 200 * 1024 * 1024
MIB = 1024 * 1024
HELLO = [{"role": "user", "content": "Say hi"}]


def _rf(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}


def _obj(props: dict, required: bool = True) -> dict:
    return {"type": "object", "properties": props, **({"required": list(props)} if required else {})}


def _chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "a"\n' for i in range(n)) + f'r{n} ::= "b"'


# Families: n → the body's fields beside messages; the search finds the largest accepted n.
FAMILIES: dict[str, Callable[[int], dict]] = {
    "maxLength 1000 strings": lambda n: _rf(_obj({f"s{i}": {"type": "string", "maxLength": 1000} for i in range(n)})),
    "maxItems 1000 arrays": lambda n: _rf(_obj({f"a{i}": {"type": "array", "items": {"type": "integer"},
                                                          "maxItems": 1000} for i in range(n)})),
    "optional properties": lambda n: _rf(_obj({f"o{j}": _obj({f"p{i}": {"type": "string"} for i in range(min(999, n - j * 999))},
                                                             required=False) for j in range((n + 998) // 999)})),
    "required properties": lambda n: _rf(_obj({f"p{i}": {"type": "boolean"} for i in range(n)})),
    "enum values (long)": lambda n: _rf({"enum": [f"{i:04d}" + "v" * 56 for i in range(n)]}),
    "integer ranges (18 digits)": lambda n: _rf(_obj({f"n{i}": {"type": "integer", "minimum": -123456789012345678,
                                                                "maximum": 987654321098765432} for i in range(n)})),
    "patterns (2000 repetitions)": lambda n: _rf(_obj({f"r{i}": {"type": "string", "pattern": "^([a-z]{0,1000})[0-9]{1000}$"}
                                                       for i in range(n)})),
    "anyOf within anyOf": lambda n: _rf({"anyOf": [{"anyOf": [{"const": f"{i}.{j}"} for j in range(40)]}
                                                   for i in range(n)]}),
    "32 levels, optional at each": lambda n: _rf(_nested(32, n)),
    "tools (128, parameters)": lambda n: {"tools": [{"type": "function", "function": {"name": f"t{t}", "parameters": _obj(
        {f"p{i}": {"type": "string", "maxLength": 1000} for i in range(n)})}} for t in range(128)],
                                          "tool_choice": "required"},
    "GBNF {0,1999} repetitions": lambda n: {"grammar": "root ::= " + " ".join(["[a-z]{0,1999}"] * n)},
    "GBNF literal ×1999": lambda n: {"grammar": 'root ::= "' + "a" * n + '"{1999}'},
    "GBNF left chain": lambda n: {"grammar": _chain(n)},
    "GBNF alternatives": lambda n: {"grammar": "root ::= " + " | ".join(f'"{i}"' for i in range(n))},
    "GBNF nested groups": lambda n: {"grammar": "root ::= " + "(" * n + '"a"' + ")" * n},
    "logit_bias (text keys)": lambda n: {"logit_bias": {f"{i} " + "word " * 190: -50 for i in range(n)}},
    "stop strings": lambda n: {"stop": ["x" * n] * 8},
}


def _nested(levels: int, width: int) -> dict:
    schema: dict = {"type": "string"}
    for level in range(levels):
        schema = _obj({"deeper": schema, **{f"l{level}p{i}": {"type": "integer"} for i in range(width)}}, required=False)
    return schema


REFUSED = {
    "issue's 150-byte format": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "maxLength": 100000000}}, "required": ["a"]}}}},
    "pattern a{100000000}": _rf({"type": "string", "pattern": "^a{100000000}$"}),
    "GBNF {5,3} (hung llama.cpp)": {"grammar": 'root ::= "a"{5,3}'},
    "GBNF 30 KB literal ×1999": {"grammar": 'root ::= "' + "a" * 30_000 + '"{1999}'},
}


@dataclass
class Row:
    """One body's figures."""

    name: str
    n: int
    body_bytes: int
    accepted: bool
    convert_ms: float = 0.0
    compile_ms: float = 0.0
    compile_mib: float = 0.0
    runner_ms: float = 0.0
    runner_peak_mib: float = 0.0
    runner_after_mib: float = 0.0
    status: int = 0
    note: str = ""


def _body(extra: dict) -> dict:
    return {"messages": HELLO, "max_tokens": 4, "temperature": 0, **extra}


def _build(extra: dict):
    """What the runner builds of a body: (grammar or None, refusal message or None), caches cold."""
    from app.engine import grammar as g
    from app.engine.formats.detection import GENERIC
    from app.engine.formats.grammars import call_grammar
    from app.protocols.openai import ApiError, ChatBody, parse_body

    g._schema_gbnf.cache_clear()
    g._calls_gbnf.cache_clear()
    g._layout_gbnf.cache_clear()
    try:
        body, _ = parse_body(json.dumps(_body(extra)).encode(), ChatBody)
        if body.tools:
            return call_grammar(GENERIC, body.tool_list, "required", True), None
        if body.response_format is not None:
            return g.schema_grammar(body.response_format.json_schema.schema_), None
        if body.grammar:
            return g.client_grammar(body.grammar), None
        return None, None
    except (ApiError, g.UnsupportedSchema, g.GrammarTooLarge, g.InvalidGrammar) as exc:
        return None, str(getattr(exc, "message", exc))


def _largest(family: Callable[[int], dict]) -> int:
    """The largest n whose body fits 64 KiB and is accepted (door and conversion); 0 if none is."""
    def ok(n: int) -> bool:
        extra = family(n)
        return len(json.dumps(_body(extra))) <= MAX_BODY_BYTES and _build(extra)[1] is None

    lo, hi = 0, 1
    while ok(hi) and hi < 1 << 20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _peak_reset(pid: int) -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _vocab(model_path: str):
    import llama_cpp

    load_backends()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not read the vocabulary of {model_path}")
    return model, llama_cpp.llama_model_get_vocab(model)


def _in_process(row: Row, extra: dict, vocab) -> None:
    import llama_cpp

    t0 = time.perf_counter()
    grammar, refusal = _build(extra)
    row.convert_ms = (time.perf_counter() - t0) * 1000
    row.accepted = refusal is None
    if refusal is not None:
        row.note = refusal[:90]
        return
    if grammar is None:
        return
    pid = os.getpid()
    _peak_reset(pid)
    before = _status_kib(pid, "VmRSS")
    t0 = time.perf_counter()
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.gbnf.encode(), grammar.root.encode())
    row.compile_ms = (time.perf_counter() - t0) * 1000
    row.compile_mib = (_status_kib(pid, "VmHWM") - before) / 1024
    if not sampler:
        row.note = "llama.cpp refused the grammar"
        return
    llama_cpp.llama_sampler_free(sampler)
    row.note = f"{len(grammar.gbnf):,} chars of GBNF, {grammar.elements:,} elements"


def _start_runner(model_path: str, threads: int) -> tuple[subprocess.Popen, httpx.Client, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "runner", "--model", model_path, "--port", str(port),
                             "--ctx", "1024", "--parallel", "2", "--threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode(errors="replace"))
        try:
            if client.get("/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the runner did not become ready in 300 s")
        time.sleep(0.2)
    parent = psutil.Process(proc.pid)
    children = parent.children(recursive=True)
    worker = max(children, key=lambda p: p.memory_info().rss) if children else parent
    return proc, client, worker.pid


def _on_runner(row: Row, extra: dict, client: httpx.Client, pid: int, baseline_kib: int) -> None:
    _peak_reset(pid)
    before = _status_kib(pid, "VmRSS")
    t0 = time.perf_counter()
    r = client.post("/v1/chat/completions", json=_body(extra))
    row.runner_ms = (time.perf_counter() - t0) * 1000
    row.status = r.status_code
    row.runner_peak_mib = (_status_kib(pid, "VmHWM") - before) / 1024
    row.runner_after_mib = (_status_kib(pid, "VmRSS") - baseline_kib) / 1024


def _print(rows: list[Row]) -> None:
    head = (f"{'body':<30} {'n':>6} {'KiB':>5} {'ok':>3} {'door+conv ms':>12} {'llama ms':>9} {'llama +MB':>9} "
            f"{'runner ms':>9} {'peak +MB':>8} {'held +MB':>8} {'HTTP':>4}  note")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r.name:<30} {r.n:>6} {r.body_bytes / 1024:>5.1f} {'yes' if r.accepted else 'no':>3} "
              f"{r.convert_ms:>12.1f} {r.compile_ms:>9.1f} {r.compile_mib:>9.1f} {r.runner_ms:>9.1f} "
              f"{r.runner_peak_mib:>8.1f} {r.runner_after_mib:>8.1f} {r.status:>4}  {r.note}")


def run_hostile_bench(args, model_path: str) -> int:
    """Search the worst accepted bodies, measure them in process and on a real runner, print the table."""
    only = set(args.only.split(",")) if args.only else None
    rows: list[tuple[Row, dict]] = []
    for name, family in FAMILIES.items():
        if only and not any(o.lower() in name.lower() for o in only):
            continue
        n = _largest(family)
        extra = family(max(n, 1))
        rows.append((Row(name, n, len(json.dumps(_body(extra))), False), extra))
        print(f"searched {name}: n = {n}", file=sys.stderr)
    for name, extra in REFUSED.items():
        rows.append((Row(name, 0, len(json.dumps(_body(extra))), False), extra))
    model, vocab = _vocab(model_path)
    for row, extra in rows:
        _in_process(row, extra, vocab)
    import llama_cpp

    llama_cpp.llama_model_free(model)
    proc, client, pid = _start_runner(model_path, args.threads)
    try:
        baseline = _status_kib(pid, "VmRSS")
        for row, extra in rows:
            _on_runner(row, extra, client, pid, baseline)
        alive = proc.poll() is None and client.get("/health").status_code == 200
    finally:
        client.close()
        stop_process(proc)
    table = [row for row, _ in rows]
    _print(table)
    accepted = [r for r in table if r.accepted]
    worst_compile_ms = max((r.convert_ms + r.compile_ms for r in accepted), default=0.0)
    worst_extra_mib = max((max(r.runner_peak_mib, r.compile_mib) for r in accepted), default=0.0)
    refused_cost = max((r.runner_peak_mib for r in table if not r.accepted), default=0.0)
    held = max((r.runner_after_mib for r in table), default=0.0)
    ok = (worst_compile_ms <= TARGET_COMPILE_S * 1000 and worst_extra_mib * MIB <= TARGET_EXTRA_BYTES and alive
          and all(r.status == 200 for r in accepted) and all(400 <= r.status < 500 for r in table if not r.accepted))
    print(f"\nworst accepted body: {worst_compile_ms:.0f} ms of conversion + compile (target ≤ "
          f"{TARGET_COMPILE_S * 1000:.0f} ms), {worst_extra_mib:.1f} MB extra at its peak (target ≤ "
          f"{TARGET_EXTRA_BYTES / MIB:.0f} MB)")
    print(f"refused bodies: at most {refused_cost:.1f} MB extra; the runner holds {held:.1f} MB more than at the "
          f"start after all of them; runner alive at the end: {alive}")
    print("target met" if ok else "TARGET MISSED")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"rows": [r.__dict__ for r in table], "worst_compile_ms": worst_compile_ms,
                       "worst_extra_mib": worst_extra_mib, "runner_alive": alive, "target_met": ok}, f, indent=2)
    return 0 if ok else 1
