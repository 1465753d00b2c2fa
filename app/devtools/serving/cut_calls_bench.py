"""Tool calls cut by max_tokens through `hearth serve` (issue 53): does the first call still arrive as a delta?

Home Assistant's voice pipeline offers its intents and may have several calls cut by a short max_tokens.
This sends `--requests` streamed chat requests shaped as Home Assistant sends them (two of its intents,
tool_choice "required", max_tokens 96, the runner's default sampling) through a `hearth serve` with default
settings and counts, per stream: whether a tool_calls delta carried the first call whole (its arguments a
JSON object) before the stream's end, and whether any content holds a whole call as text (which a client
would show the user as JSON).

    python -m app.devtools.serving.cut_calls_bench [--model GGUF] [--requests 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import httpx

from app.devtools.ha_tools import HA_TOOLS, ha_chat_body, sample_commands
from app.devtools.serve_process import BenchServe
from app.protocols import sse

MAX_TOKENS = 96
TOOL_NAMES = [t["function"]["name"] for t in HA_TOOLS[:2]]


def read_stream(r: httpx.Response) -> dict:
    """One stream's evidence: calls as their deltas built them, the content, the finish and when the first call was
    whole (the index of the chunk, against the chunk count)."""
    calls: dict[int, dict] = {}
    content, finish, chunks, first_whole_at = "", None, 0, None
    for payload in sse.payloads(r.iter_bytes()):
        if not isinstance(payload, dict):
            continue
        for choice in payload.get("choices") or []:
            chunks += 1
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for d in delta.get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                call["name"] += (d.get("function") or {}).get("name") or ""
                call["arguments"] += (d.get("function") or {}).get("arguments") or ""
            if first_whole_at is None and 0 in calls and is_object(calls[0]["arguments"]):
                first_whole_at = chunks
            finish = choice.get("finish_reason") or finish
    return {"calls": [calls[i] for i in sorted(calls)], "content": content, "finish_reason": finish,
            "chunks": chunks, "first_call_whole_at_chunk": first_whole_at}


def is_object(text: str) -> bool:
    """Whether text is a whole JSON object."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def content_holds_a_call(content: str) -> bool:
    """Whether content spells a whole call to one of the offered tools (JSON a client would show as text)."""
    for name in TOOL_NAMES:
        at = content.find(f'"{name}"')
        if at != -1 and '"arguments"' in content[at:] and "}" in content[at:]:
            return True
    return False


def run(model: str, requests: int, out: str | None) -> dict:
    """Start serve, send the requests one after another, print and return the figures."""
    serve = BenchServe(model)
    rows = []
    try:
        name = serve.model_name()
        with httpx.Client(base_url=serve.url, headers=serve.headers, timeout=300) as client:
            for command in sample_commands(requests):
                body = ha_chat_body(command, "required", stream=True, tools=HA_TOOLS[:2])
                body.pop("temperature")  # default sampling, as the issue measured it
                body.update(model=name, max_tokens=MAX_TOKENS)
                started = time.monotonic()
                with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    row = read_stream(r)
                row.update(command=command, seconds=round(time.monotonic() - started, 3))
                row["first_call_as_delta"] = bool(row["calls"]) and is_object(row["calls"][0]["arguments"])
                row["call_as_content"] = content_holds_a_call(row["content"])
                rows.append(row)
                print(f"  {command!r:45} finish={row['finish_reason']:10} calls={len(row['calls'])} "
                      f"first_as_delta={row['first_call_as_delta']} call_as_content={row['call_as_content']}",
                      flush=True)
    finally:
        serve.stop()
    summary = {"model": model, "cpu": platform.processor() or platform.machine(), "requests": len(rows),
               "tools": TOOL_NAMES, "tool_choice": "required", "max_tokens": MAX_TOKENS, "stream": True,
               "sampling": "the runner's default", "through": "hearth serve, default settings",
               "first_call_as_delta": sum(r["first_call_as_delta"] for r in rows),
               "call_as_content": sum(r["call_as_content"] for r in rows),
               "finish_length": sum(r["finish_reason"] == "length" for r in rows)}
    print(f"{summary['first_call_as_delta']} of {len(rows)} streams carried the first call as a delta; "
          f"{summary['call_as_content']} returned a whole call as content; "
          f"{summary['finish_length']} were cut (finish_reason length)")
    if out:
        Path(out).write_text(json.dumps({"summary": summary, "requests": rows}, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    from app.runner.command import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="GGUF path (default: the embedded Gemma 3 270M)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--out", help="write the summary and every stream's evidence here (JSON)")
    args = p.parse_args(argv)
    summary = run(resolve_model(args.model), args.requests, args.out)
    return 0 if summary["first_call_as_delta"] == summary["requests"] and not summary["call_as_content"] else 1


if __name__ == "__main__":
    sys.exit(main())
