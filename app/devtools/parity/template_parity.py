"""Render parity: llama.cpp's vendored chat templates through stock llama-server and `hearth runner`, byte for byte.

For every template in the pinned llama.cpp tree's models/templates and each of five histories, the same body is
POSTed to stock llama-server's /apply-template (`--jinja --chat-template-file T`) and to a `hearth runner` started
with the same flags; the prompts are compared byte for byte. Both servers of a template run at the same moment, so
the dates templates print (`datetime`, `date_string`, strftime_now) agree.

    hearth bench templates [--only WORDS] [--json FILE] [--record DIR] [--hearth-src DIR]

--hearth-src runs the runner from another copy of Hearth's `app` (e.g. `git archive <commit> app | tar -x -C DIR`),
to measure an older commit, or this one while the working tree is mid-edit.

--record writes llama-server's renders as golden files (one JSON file per template, keyed by the template's
file name and the sha256 of its source), which tests/engine/test_template_goldens.py renders in-process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import date, datetime
from datetime import time as datetime_time
from pathlib import Path

import httpx

from app.devtools.processes import stop_process
from app.devtools.stock_server import stock_command
from app.llama_tools import BUILD_SCRIPT, stock_llama_server, tools_cache_dir

_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
_TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}

# Nine alphanumeric characters: the tool-call ids Mistral's templates insist on, which every other template takes.
_CALLS = [
    {"id": "a1b2c3d4e", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}},
    {"id": "f5g6h7i8j", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone": "Europe/Oslo"}'}},
]

# The five histories: the body each one POSTs (to both servers alike).
HISTORIES: dict[str, dict] = {
    "plain": {"messages": [{"role": "user", "content": "Hello! Who are you?"}]},
    "multi_turn": {"messages": [
        {"role": "system", "content": "You are a helpful assistant for a household."},
        {"role": "user", "content": "What is the capital of Norway?"},
        {"role": "assistant", "content": "The capital of Norway is Oslo."},
        {"role": "user", "content": "And of Sweden?"}]},
    "tools": {"tools": [_WEATHER, _TIME], "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather and the time in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": _CALLS},
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "name": "get_weather", "content": '{"temperature": 4}'},
        {"role": "tool", "tool_call_id": "f5g6h7i8j", "name": "get_time", "content": '{"time": "14:05"}'},
        {"role": "assistant", "content": "It is 4 °C in Oslo, and the time there is 14:05."},
        {"role": "user", "content": "Thanks!"}]},
    "reasoning": {"messages": [
        {"role": "user", "content": "What is 17 times 3?"},
        {"role": "assistant", "content": "17 times 3 is 51.",
         "reasoning_content": "17 times 3: 10 times 3 is 30, 7 times 3 is 21, 30 + 21 = 51."},
        {"role": "user", "content": "And 17 times 4?"}]},
    "thinking_off": {"chat_template_kwargs": {"enable_thinking": False}, "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Is the sky blue?"}]},
}

# What both servers are started with, beside the template.
_CTX = 1024
_THREADS = 1
_READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Render:
    """One server's answer to one body: the prompt, or why it was refused."""

    prompt: str | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the server rendered the body."""
        return self.prompt is not None


@dataclass
class TemplateResult:
    """One template's renders on both servers, by history name."""

    name: str
    sha256: str
    stock: dict[str, Render] = field(default_factory=dict)
    hearth: dict[str, Render] = field(default_factory=dict)

    def outcome(self, history: str) -> str:
        """identical, different, hearth_refused, both_refused or stock_refused (Hearth renders what stock refuses)."""
        s, h = self.stock[history], self.hearth[history]
        if s.ok and h.ok:
            return "identical" if s.prompt == h.prompt else "different"
        if s.ok:
            return "hearth_refused"
        return "stock_refused" if h.ok else "both_refused"


def templates_dir() -> Path:
    """models/templates of the llama.cpp tree vendored in the pinned sdist (unpacked by the build script)."""
    src = tools_cache_dir() / "src"
    for candidate in sorted(src.glob("llama_cpp_python-*/vendor/llama.cpp/models/templates")):
        return candidate
    raise SystemExit(f"hearth bench templates: no models/templates under {src}; run {BUILD_SCRIPT} first")


def source_sha256(path: Path) -> str:
    """The sha256 of a template's source bytes (what the golden files are keyed by)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """A server process on a loopback port, stopped on exit."""

    def __init__(self, argv: list[str], port: int, src: Path | None = None):
        self.port = port
        # `python -m` puts the working folder first on sys.path: another copy of Hearth runs from its own folder.
        env = {**os.environ, "PYTHONPATH": str(src)} if src else None
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=src)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        self.failure: str | None = None

    def wait_ready(self) -> None:
        """Poll /health until it answers 200; a server that exits records why (e.g. a template that fails)."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.proc.stderr.read() or b"").decode(errors="replace").strip().splitlines()[-3:]
                self.failure = "did not start: " + " | ".join(tail)
                return
            with contextlib.suppress(httpx.TransportError):
                r = self.client.get("/health")
                if r.status_code == 200:
                    return
                if r.status_code != 503:
                    # A load that failed (a template that does not compile) answers an error, never ready.
                    self.failure = f"{r.status_code}: {_error_message(r)}"
                    return
            time.sleep(0.1)
        self.failure = f"not ready in {_READY_TIMEOUT_S:.0f} s"

    def render(self, body: dict) -> Render:
        """POST /apply-template."""
        if self.failure:
            return Render(None, self.failure)
        try:
            r = self.client.post("/apply-template", json=body)
        except httpx.TransportError as exc:
            return Render(None, f"{type(exc).__name__}: {exc}")
        if r.status_code == 200:
            return Render(r.json()["prompt"])
        return Render(None, f"{r.status_code}: {_error_message(r)}")

    def stop(self) -> None:
        """Terminate and reap the process."""
        self.client.close()
        stop_process(self.proc, 10)
        if self.proc.stderr:
            self.proc.stderr.close()


def _error_message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:300]


def _stock_argv(binary: Path, model: str, template: Path, port: int) -> list[str]:
    return stock_command(binary, model, "--jinja", "--chat-template-file", str(template), "-c", str(_CTX),
                         "-t", str(_THREADS), "-np", "1", "--no-webui", port=port, same_cache=False)


def _hearth_argv(model: str, template: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "app.cli", "runner", "-m", model, "--jinja", "--chat-template-file", str(template),
            "--port", str(port), "-c", str(_CTX), "-t", str(_THREADS), "-np", "1"]


def compare_template(binary: Path, model: str, template: Path, hearth_src: Path | None = None) -> TemplateResult:
    """Both servers started on one template at once, every history posted to each, then both stopped."""
    result = TemplateResult(template.name, source_sha256(template))
    servers = {"stock": _Server(_stock_argv(binary, model, template, p := _free_port()), p),
               "hearth": _Server(_hearth_argv(model, template, q := _free_port()), q, hearth_src)}
    try:
        waiters = [threading.Thread(target=s.wait_ready) for s in servers.values()]
        for w in waiters:
            w.start()
        for w in waiters:
            w.join()
        for history, body in HISTORIES.items():
            result.stock[history] = servers["stock"].render(body)
            result.hearth[history] = servers["hearth"].render(body)
    finally:
        for s in servers.values():
            s.stop()
    return result


def first_difference(a: str, b: str) -> int:
    """The first offset where two texts differ (the shorter one's length if one is a prefix of the other)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


OUTCOMES = ("identical", "different", "hearth_refused", "both_refused", "stock_refused")


def summary(results: list[TemplateResult]) -> dict:
    """Counts per outcome over every pair, and the parity share over the pairs stock llama-server renders."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for r in results:
        for h in HISTORIES:
            counts[r.outcome(h)] += 1
    rendered = counts["identical"] + counts["different"] + counts["hearth_refused"]
    return {**counts, "stock_rendered": rendered,
            "parity_pct": round(100.0 * counts["identical"] / rendered, 2) if rendered else 0.0}


def print_table(results: list[TemplateResult]) -> None:
    """The table: per template, identical / rendered by llama-server / refused by Hearth only / refused by both."""
    width = max([len(r.name) for r in results] + [8])
    print(f"{'template':<{width}}  identical  rendered by llama-server  refused by Hearth only  refused by both")
    for r in results:
        o = [r.outcome(h) for h in HISTORIES]
        rendered = sum(x in ("identical", "different", "hearth_refused") for x in o)
        print(f"{r.name:<{width}}  {o.count('identical'):>9}  {rendered:>24}  {o.count('hearth_refused'):>22}  "
              f"{o.count('both_refused'):>15}")
    s = summary(results)
    print(f"{'total':<{width}}  {s['identical']:>9}  {s['stock_rendered']:>24}  {s['hearth_refused']:>22}  "
          f"{s['both_refused']:>15}")
    print(f"render parity: {s['identical']} of {s['stock_rendered']} pairs llama-server renders are byte-identical "
          f"({s['parity_pct']:.1f} %, target >= 98 %); {s['different']} differ, {s['stock_refused']} rendered by "
          f"Hearth only")


def details(results: list[TemplateResult]) -> list[dict]:
    """Every pair that is not identical: both answers, the first differing offset and the text around it."""
    out = []
    for r in results:
        for h in HISTORIES:
            outcome = r.outcome(h)
            if outcome == "identical":
                continue
            s, m = r.stock[h], r.hearth[h]
            row = {"template": r.name, "history": h, "outcome": outcome, "stock_error": s.error,
                   "hearth_error": m.error}
            if s.ok and m.ok:
                at = first_difference(s.prompt, m.prompt)
                row |= {"offset": at, "stock": s.prompt[max(0, at - 60):at + 120],
                        "hearth": m.prompt[max(0, at - 60):at + 120]}
            out.append(row)
    return out


def date_dependent(prompts: list[str], day: date) -> bool:
    """Whether any of these renders prints the day (then the golden file keeps the date it was rendered on)."""
    marks = {day.strftime(f) for f in ("%d %b %Y", "%b %d %Y", "%Y-%m-%d", "%d %B %Y", "%B %d, %Y")}
    return any(m in p for p in prompts for m in marks)


def write_goldens(results: list[TemplateResult], folder: Path, day: date, bos: str, eos: str) -> None:
    """One JSON file per template: llama-server's renders of each history (or its refusal)."""
    folder.mkdir(parents=True, exist_ok=True)
    for r in results:
        prompts = [x.prompt for x in r.stock.values() if x.ok]
        doc = {"template": r.name, "sha256": r.sha256, "bos_token": bos, "eos_token": eos,
               "date": day.isoformat() if date_dependent(prompts, day) else None,
               "renders": {h: ({"prompt": x.prompt} if x.ok else {"error": x.error}) for h, x in r.stock.items()}}
        (folder / (Path(r.name).stem + ".json")).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


def _model_special_tokens(model: str) -> tuple[str, str]:
    from app.engine.chat import _read_gguf_chat_metadata, _special_tokens

    return _special_tokens(_read_gguf_chat_metadata(model))


def run_templates_bench(args, model: str) -> int:
    """`hearth bench templates`: the table, --json details, --record golden files; exit 1 below the target."""
    binary = Path(args.llama_server) if args.llama_server else stock_llama_server()
    if binary is None or not binary.is_file():
        raise SystemExit(f"hearth bench templates: stock llama-server is not built; run {BUILD_SCRIPT}")
    paths = sorted(templates_dir().glob("*.jinja"))
    if args.only:
        words = [w.strip().lower() for w in args.only.split(",") if w.strip()]
        paths = [p for p in paths if any(w in p.name.lower() for w in words)]
    day = date.today()
    results = []
    for i, path in enumerate(paths, 1):
        print(f"\r[{i}/{len(paths)}] {path.name[:70]:<70}", end="", file=sys.stderr, flush=True)
        results.append(compare_template(binary, model, path, Path(args.hearth_src) if args.hearth_src else None))
    print(file=sys.stderr)
    print_table(results)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"summary": summary(results), "model": model, "date": day.isoformat(),
                                                    "pairs": details(results)}, indent=1, ensure_ascii=False))
    if args.record:
        write_goldens(results, Path(args.record), day, *_model_special_tokens(model))
    return 0 if summary(results)["parity_pct"] >= 98.0 else 1


def render_in_process(source: str, body: dict, bos: str, eos: str, day: date | None = None,
                      reasoning: str = "auto") -> Render:
    """One history through Hearth's chat prompt in this process, as a runner on this template builds it."""
    from app.engine import formats
    from app.engine import tools as toolfmt
    from app.engine.chat import ChatTemplate, ChatTemplateError
    from app.protocols.openai import ApiError, ApplyTemplateBody
    from app.runner.prompts import chat_text

    when = datetime.combine(day, datetime_time(12)) if day else None
    try:
        template = ChatTemplate(source, bos, eos, origin="command line",
                                **({"clock": lambda: when} if when else {}))
    except ChatTemplateError as exc:
        return Render(None, str(exc))
    fmt = formats.detect(source)
    parsed = ApplyTemplateBody.model_validate(body)
    asked = (parsed.chat_template_kwargs or {}).get("enable_thinking")
    thinking = asked if isinstance(asked, bool) else parsed.reasoning_effort != "none" and reasoning != "off"
    try:
        text, _ = chat_text(template, parsed, thinking=thinking,
                            tool_format=fmt.name if fmt.tools else toolfmt.GENERIC, add_bos=True)
    except ApiError as exc:
        return Render(None, exc.message if hasattr(exc, "message") else str(exc))
    return Render(text)
