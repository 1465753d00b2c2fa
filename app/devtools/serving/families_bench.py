"""The families' scripted answers through a real `hearth serve`, in every API, whole and streamed.

For each family (app/devtools/family_models.py) and each of its scripts, the model is made to emit
the script's raw text: through OpenAI chat by the request's `grammar` field; through Ollama,
Anthropic and Responses, which carry no grammar, by the runner's default grammar (`--grammar-file`,
given per model with the runner_args setting): the file is rewritten and the model unloaded
(Ollama keep_alive 0) so that the next request starts a runner on the next script.

Each answer is read back into the same three fields (reasoning, content, calls) from the API's own
shape (OpenAI reasoning_content / content / tool_calls; Ollama message.thinking / tool_calls;
Anthropic thinking, text and tool_use blocks; Responses reasoning, message and function_call items),
judged against the script, and every stream is compared with the whole answer: its deltas must
concatenate to exactly the whole answer's fields.

`hearth bench families` prints the table family × API × whole/stream, beside stock llama-server
(`--jinja`, the same GGUF and grammar, OpenAI chat only).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from app.devtools.family_models import FAMILIES, TOOLS, FamilyModel, Script, family_model, load_scripts
from app.devtools.gguf_shapes import SHAPES, make_model
from app.devtools.processes import stop_process
from app.devtools.serve_process import ServeProcess, prepare_data
from app.devtools.stock_server import stock_command
from app.protocols import sse

APIS = ("openai", "ollama", "anthropic", "responses")
QUESTION = "What is the weather in Paris?"
READY_TIMEOUT_S = 60
# Every script says one of these (tests/data/families): an answer with none of them was not forced.
SCRIPT_MARKERS = ("Paris", "city", "Tokyo", "Let me")


@dataclass
class Got:
    """One answer read back: its reasoning, content and calls ({name, arguments}: arguments as the API gave them)."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)
    error: str | None = None

    def fields(self) -> dict:
        """What a stream must reproduce exactly: reasoning, content and each call's name and arguments."""
        return {"reasoning": self.reasoning, "content": self.content,
                "calls": [(c["name"], _args_object(c["arguments"])) for c in self.calls]}

    def brief(self) -> str:
        """A one-line account of what arrived."""
        if self.error:
            return f"error {self.error[:200]}"
        calls = ", ".join(f"{c['name']}({c['arguments'] if isinstance(c['arguments'], str) else json.dumps(c['arguments'])})"
                          for c in self.calls)
        return f"reasoning={_short(self.reasoning)} content={_short(self.content)} calls=[{calls}]"


def _short(text: str, limit: int = 160) -> str:
    """repr(text), its middle cut past `limit` characters."""
    r = repr(text)
    return r if len(r) <= limit else f"{r[:limit // 2]}…({len(text)} chars)…{r[-limit // 2:]}"


def _args_object(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


# -- requests, one builder and two readers per API ---------------------------------------------------------

def needs_tools(script: Script) -> bool:
    """The request offers tools: the script calls one, or writes a malformed call (a parser only looks for
    calls when tools are offered).

    The others go without: a request with tools gets a lazy call grammar, which outranks a runner's default
    grammar (in llama-server and in hearth runner alike), and the runner's default grammar is what forces
    the answer through the APIs that carry no grammar of their own.
    """
    return bool(script.expect["calls"]) or script.name.startswith("malformed")


def _body(api: str, model: str, script: Script, stream: bool, grammar: str | None) -> tuple[str, dict]:
    """The API's path and request body for one script."""
    tools = TOOLS if needs_tools(script) else []
    if api == "openai":
        body = {"model": model, "messages": [{"role": "user", "content": QUESTION}],
                "temperature": 0, "max_tokens": script.max_tokens, "stream": stream}
        if grammar is not None:
            body["grammar"] = grammar
    elif api == "ollama":
        body = {"model": model, "messages": [{"role": "user", "content": QUESTION}],
                "stream": stream, "options": {"temperature": 0, "num_predict": script.max_tokens}}
    elif api == "anthropic":
        tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                  "input_schema": t["function"]["parameters"]} for t in tools]
        body = {"model": model, "max_tokens": script.max_tokens, "temperature": 0, "stream": stream,
                "messages": [{"role": "user", "content": QUESTION}]}
    elif api == "responses":
        tools = [{"type": "function", **t["function"]} for t in tools]
        body = {"model": model, "input": QUESTION, "temperature": 0, "max_output_tokens": script.max_tokens,
                "stream": stream}
    else:
        raise ValueError(f"unknown API {api!r}")
    if tools:
        body["tools"] = tools
    return PATHS[api], body


PATHS = {"openai": "/v1/chat/completions", "ollama": "/api/chat", "anthropic": "/v1/messages",
         "responses": "/v1/responses"}


def _read_whole(api: str, data: dict) -> Got:
    got = Got()
    if api == "openai":
        msg = data["choices"][0]["message"]
        got.reasoning, got.content = msg.get("reasoning_content") or "", msg.get("content") or ""
        got.calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in msg.get("tool_calls") or []]
    elif api == "ollama":
        msg = data["message"]
        got.reasoning, got.content = msg.get("thinking") or "", msg.get("content") or ""
        got.calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in msg.get("tool_calls") or []]
    elif api == "anthropic":
        for block in data["content"]:
            if block["type"] == "thinking":
                got.reasoning += block["thinking"]
            elif block["type"] == "text":
                got.content += block["text"]
            elif block["type"] == "tool_use":
                got.calls.append({"name": block["name"], "arguments": block["input"]})
    elif api == "responses":
        for item in data["output"]:
            if item["type"] == "reasoning":
                got.reasoning += "".join(p.get("text", "") for p in item.get("content") or [])
            elif item["type"] == "message":
                got.content += "".join(p.get("text", "") for p in item["content"] if p["type"] == "output_text")
            elif item["type"] == "function_call":
                got.calls.append({"name": item["name"], "arguments": item["arguments"]})
    return got


def _read_openai_stream(payloads: Iterator[dict], got: Got) -> None:
    calls: dict[int, dict] = {}
    for chunk in payloads:
        if "error" in chunk:
            got.error = json.dumps(chunk["error"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            got.reasoning += delta.get("reasoning_content") or ""
            got.content += delta.get("content") or ""
            for c in delta.get("tool_calls") or []:
                fn = c.get("function") or {}
                call = calls.setdefault(c["index"], {"name": "", "arguments": ""})
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
    got.calls = [calls[i] for i in sorted(calls)]


def _read_anthropic_stream(payloads: Iterator[dict], got: Got) -> None:
    blocks: dict[int, dict] = {}
    for ev in payloads:
        if ev.get("type") == "error":
            got.error = json.dumps(ev.get("error"))
        elif ev.get("type") == "content_block_start":
            blocks[ev["index"]] = {**ev["content_block"], "json": ""}
        elif ev.get("type") == "content_block_delta":
            d, b = ev["delta"], blocks[ev["index"]]
            if d["type"] == "thinking_delta":
                got.reasoning += d["thinking"]
            elif d["type"] == "text_delta":
                got.content += d["text"]
            elif d["type"] == "input_json_delta":
                b["json"] += d["partial_json"]
    got.calls = [{"name": b["name"], "arguments": _args_object(b["json"] or "{}")}
                 for _, b in sorted(blocks.items()) if b["type"] == "tool_use"]


def _read_responses_stream(payloads: Iterator[dict], got: Got) -> None:
    calls: dict[int, dict] = {}
    for ev in payloads:
        kind = ev.get("type", "")
        if kind in ("error", "response.failed"):
            got.error = json.dumps(ev)[:300]
        elif kind == "response.reasoning_text.delta":
            got.reasoning += ev["delta"]
        elif kind == "response.output_text.delta":
            got.content += ev["delta"]
        elif kind == "response.output_item.added" and ev["item"]["type"] == "function_call":
            calls[ev["output_index"]] = {"name": ev["item"]["name"], "arguments": ""}
        elif kind == "response.function_call_arguments.delta":
            calls[ev["output_index"]]["arguments"] += ev["delta"]
    got.calls = [calls[i] for i in sorted(calls)]


def _read_stream(api: str, r: httpx.Response) -> Got:
    got = Got()
    if api == "ollama":
        calls = []
        for line in r.iter_lines():
            if not line.strip():
                continue
            chunk = json.loads(line)
            if "error" in chunk:
                got.error = str(chunk["error"])
                continue
            msg = chunk.get("message") or {}
            got.reasoning += msg.get("thinking") or ""
            got.content += msg.get("content") or ""
            calls += [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                      for c in msg.get("tool_calls") or []]
        got.calls = calls
        return got
    payloads = (p for p in sse.payloads(r.iter_bytes()) if isinstance(p, dict))
    {"openai": _read_openai_stream, "anthropic": _read_anthropic_stream,
     "responses": _read_responses_stream}[api](payloads, got)
    return got


def ask(client: httpx.Client, api: str, model: str, script: Script, stream: bool, grammar: str | None = None) -> Got:
    """Send one script's request and read the answer back into reasoning, content and calls."""
    path, body = _body(api, model, script, stream, grammar)
    try:
        if not stream:
            r = client.post(path, json=body)
            if r.status_code != 200:
                return Got(error=f"{r.status_code} {r.text[:300]}")
            return _read_whole(api, r.json())
        with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                return Got(error=f"{r.status_code} {r.text[:300]}")
            return _read_stream(api, r)
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
        return Got(error=f"{type(exc).__name__}: {exc}")


# -- judging ------------------------------------------------------------------------------------------------

def judge(script: Script, got: Got) -> list[str]:
    """What is wrong with the answer against the script (empty: split right)."""
    if got.error:
        return [got.error]
    if not got.calls and not any(m in got.reasoning + got.content for m in SCRIPT_MARKERS):
        return [f"not forced: {_short(got.content)} arrived, none of the script's words, so the grammar that spells "
                "it did not apply (with tools offered, a runner's lazy call grammar outranks its default grammar)"]
    exp, problems = script.expect, []
    reasoning, content = got.reasoning.strip(), got.content.strip()
    if script.cut:
        if not reasoning or not exp["reasoning"].startswith(reasoning):
            problems.append(f"reasoning {_short(got.reasoning)} is not the start of the cut thought")
        if content or got.calls:
            problems.append(f"a cut thought leaked: content {_short(got.content)}, {len(got.calls)} calls")
        return problems
    if reasoning != exp["reasoning"].strip():
        problems.append(f"reasoning {_short(got.reasoning)}, expected {exp['reasoning']!r}")
    if "content_contains" in exp:
        if exp["content_contains"] not in got.content or (exp["reasoning"] and exp["reasoning"] in content):
            problems.append(f"content {_short(got.content)} should hold {exp['content_contains']!r} and no reasoning")
    elif content != exp["content"].strip():
        problems.append(f"content {_short(got.content)}, expected {exp['content']!r}")
    want = [(c["name"], c["arguments"]) for c in exp["calls"]]
    have = [(c["name"], _args_object(c["arguments"])) for c in got.calls]
    if have != want:
        problems.append(f"calls {have}, expected {want}")
    return problems


def stream_mismatch(whole: Got, streamed: Got) -> str | None:
    """How a stream's concatenated deltas differ from the whole answer, or None when they are the same."""
    if whole.error or streamed.error:
        return None
    a, b = whole.fields(), streamed.fields()
    diffs = [f"{k}: stream {_short(str(b[k]))} vs whole {_short(str(a[k]))}" for k in a if a[k] != b[k]]
    return "; ".join(diffs) or None


@dataclass
class Outcome:
    """One family × script × API × whole/stream: right or what was wrong."""

    target: str  # "hearth" or "llama-server"
    family: str
    script: str
    api: str
    stream: bool
    problems: list[str]
    got: str

    @property
    def right(self) -> bool:
        """The split was right (and, for a stream, equal to the whole answer)."""
        return not self.problems

    def line(self) -> str:
        """One report line."""
        how = "stream" if self.stream else "whole"
        verdict = "right" if self.right else "WRONG: " + " | ".join(self.problems)
        return f"{self.target:12} {self.family:16} {self.script:18} {self.api:9} {how:6} {verdict}"


def check_pair(target: str, script: Script, api: str, whole: Got, streamed: Got) -> list[Outcome]:
    """The outcomes of one whole and one streamed answer to a script."""
    out = [Outcome(target, script.family, script.name, api, False, judge(script, whole), whole.brief())]
    problems = judge(script, streamed)
    mismatch = stream_mismatch(whole, streamed)
    if mismatch:
        problems.append("stream != whole: " + mismatch)
    out.append(Outcome(target, script.family, script.name, api, True, problems, streamed.brief()))
    return out


# -- hearth serve with every family ------------------------------------------------------------------------

def _place(src: Path, dst: Path) -> None:
    """dst as a hard link to src where the filesystem allows, else a copy (serve refuses links out of its folder)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


class FamiliesServe:
    """A `hearth serve` whose models folder holds the families' doubles, each with a default grammar file."""

    def __init__(self, families: list[str], root: Path, timeout_s: float = 120):
        self.root, self.grammars = root, root / "grammars"
        data, models = root / "data", root / "models"
        for d in (models, self.grammars):
            d.mkdir(parents=True, exist_ok=True)
        self.doubles: dict[str, FamilyModel] = {name: family_model(name) for name in families}
        runner_args = {}
        for name, double in self.doubles.items():
            _place(double.path, models / f"{name}.gguf")
            self.grammar_path(name).write_text(double.gbnf(load_scripts(name)[0].raw))
            runner_args[name] = ["--grammar-file", str(self.grammar_path(name))]
        default = root / "default.gguf"
        make_model(SHAPES["tiny"], default)
        prepare_data(data, settings={"runner_args": json.dumps(runner_args), "runner_ctx": 8192, "runner_parallel": 1,
                                     "runner_threads": 1, "member_class_share": 1.0, "api_manage_models": True})
        self.token = _manage_token(data)
        self.serve = ServeProcess(data, models, default, root / "serve.log", timeout_s)
        self.client = httpx.Client(base_url=self.serve.url, timeout=120,
                                   headers={"Authorization": f"Bearer {self.token}"})

    def grammar_path(self, family: str) -> Path:
        """The default grammar file of the family's runner."""
        return self.grammars / f"{family}.gbnf"

    def use_script(self, script: Script) -> None:
        """Make the family's runner emit this script by default: rewrite its grammar file, unload the model."""
        self.grammar_path(script.family).write_text(self.doubles[script.family].gbnf(script.raw))
        r = self.client.post("/api/generate", json={"model": script.family, "keep_alive": 0})
        if r.status_code != 200:
            raise RuntimeError(f"unloading {script.family}: {r.status_code} {r.text[:300]}")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while any(m["name"].split(":")[0] == script.family for m in self.client.get("/api/ps").json()["models"]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{script.family} still loaded {READY_TIMEOUT_S} s after keep_alive 0")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop serve and its runners."""
        self.client.close()
        self.serve.stop()


def _manage_token(data: Path) -> str:
    from app.gateway.tokens import create_token
    from app.store.db import open_store

    engine, sessions = open_store(data)
    with sessions() as s:
        token, _ = create_token(s, "families", "chat", ["chat"], may_manage=True)
        s.commit()
    engine.dispose()
    return token


Report = Callable[[list[Outcome]], None]


def _ignore(outcomes: list[Outcome]) -> None:
    pass


def run_hearth(serve: FamiliesServe, families: list[str], apis: tuple[str, ...] = APIS,
               report: Report = _ignore) -> list[Outcome]:
    """Every script of every family through serve, in each API, whole and streamed (each pair reported as it comes)."""
    out: list[Outcome] = []
    for name in families:
        double = serve.doubles[name]
        scripts = load_scripts(name)
        if "openai" in apis:
            for script in scripts:
                g = double.gbnf(script.raw)
                whole = ask(serve.client, "openai", name, script, False, g)
                pair = check_pair("hearth", script, "openai", whole, ask(serve.client, "openai", name, script, True, g))
                report(pair)
                out += pair
        others = [a for a in apis if a != "openai"]
        for script in scripts if others else ():
            serve.use_script(script)
            for api in others:
                whole = ask(serve.client, api, name, script, False)
                pair = check_pair("hearth", script, api, whole, ask(serve.client, api, name, script, True))
                report(pair)
                out += pair
    return out


# -- stock llama-server -------------------------------------------------------------------------------------

def _start_llama_server(binary: Path, model: Path, grammar_file: Path, log: Path) -> tuple[subprocess.Popen, str]:
    from app.residency.supervisor import free_port

    port = free_port()
    proc = subprocess.Popen(stock_command(binary, model, "--jinja", "--ctx-size", "8192", "--parallel", "1",
                                          "--threads", "1", "--temp", "0", "--grammar-file", str(grammar_file),
                                          "--no-webui", port=port, same_cache=False),
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"llama-server not ready in {READY_TIMEOUT_S} s; see {log}")


def run_llama_server(binary: Path, families: list[str], root: Path, report: Report = _ignore) -> list[Outcome]:
    """Every script through stock llama-server (OpenAI chat), its grammar as the server's default grammar.

    llama-server refuses a request's own grammar beside tools, so each script gets a server of its own.
    """
    out: list[Outcome] = []
    for name in families:
        double = family_model(name)
        for script in load_scripts(name):
            grammar = root / f"stock-{name}.gbnf"
            grammar.write_text(double.gbnf(script.raw))
            try:
                proc, url = _start_llama_server(binary, double.path, grammar, root / "llama-server.log")
            except (RuntimeError, TimeoutError) as exc:
                pair = [Outcome("llama-server", name, script.name, "openai", s, [str(exc)], "") for s in (False, True)]
            else:
                try:
                    with httpx.Client(base_url=url, timeout=120) as client:
                        whole = ask(client, "openai", name, script, False)
                        pair = check_pair("llama-server", script, "openai", whole,
                                          ask(client, "openai", name, script, True))
                finally:
                    stop_process(proc, 10)
            report(pair)
            out += pair
    return out




def summary(outcomes: list[Outcome], target: str) -> tuple[int, int]:
    """(right, total) for one target."""
    mine = [o for o in outcomes if o.target == target]
    return sum(o.right for o in mine), len(mine)


def run_from_args(args) -> int:
    """`hearth bench families`: the table, then 'Hearth splits X of Y right; llama-server Z of Y'."""
    from app.llama_tools import stock_llama_server

    families = args.families.split(",") if args.families else list(FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise SystemExit(f"hearth: unknown families {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    apis = tuple(args.apis.split(",")) if args.apis else APIS
    unknown = [a for a in apis if a not in APIS]
    if unknown:
        raise SystemExit(f"hearth: unknown APIs {', '.join(unknown)}; choose from {', '.join(APIS)}")
    # One line per request would bury the table.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="hearth-families-") as tmp:
        root = Path(tmp)
        def report(pair: list[Outcome]) -> None:
            for o in pair:
                print(o.line(), flush=True)
                if args.verbose and not o.right:
                    print(f"{'':14}got {o.got}", flush=True)

        serve = FamiliesServe(families, root)
        try:
            outcomes = run_hearth(serve, families, apis, report)
        finally:
            serve.stop()
        binary = None if args.no_llama_server else stock_llama_server()
        if binary is not None:
            outcomes += run_llama_server(binary, families, root, report)
    right, total = summary(outcomes, "hearth")
    line = f"Hearth splits {right} of {total} right"
    if binary is not None:
        s_right, s_total = summary(outcomes, "llama-server")
        openai_total = sum(1 for o in outcomes if o.target == "hearth" and o.api == "openai")
        h_openai = sum(o.right for o in outcomes if o.target == "hearth" and o.api == "openai")
        line += f"; llama-server {s_right} of {s_total} (OpenAI chat only; Hearth there: {h_openai} of {openai_total})"
    else:
        line += "; llama-server not run (not built: scripts/build_llama_tools.sh)" if not args.no_llama_server else ""
    print(line)
    if args.json:
        Path(args.json).write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    return 0
