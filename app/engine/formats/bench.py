"""What parsing costs per generated token, for each family: `python -m app.engine.formats.bench`.

Each family's typical answer (a thought where it thinks, a paragraph of content, one call) is
pushed in token-sized chunks (4 characters, about a token of English), as a runner pushes its
stream; the figure is the mean cost of one push, finish included, in microseconds.
"""

from __future__ import annotations

import argparse
import time

from app.engine.formats import detection as formats
from app.engine.formats.base import ChatFormat
from app.engine.formats.parser import AnswerParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]
_ARGS = '{"city": "Paris", "days": 3}'
CALLS = {
    "generic": '{"tool_calls": [{"name": "get_weather", "arguments": ' + _ARGS + "}]}",
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": ' + _ARGS + "}\n</tool_call>",
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": ' + _ARGS + "}",
    "mistral": "[TOOL_CALLS]get_weather[ARGS]" + _ARGS,
    "magistral": "[TOOL_CALLS]get_weather[ARGS]" + _ARGS,
    "deepseek_r1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n" + _ARGS +
                   "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + _ARGS +
                   "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": ' + _ARGS + "}]",
    "command_r": '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": ' + _ARGS +
                 "}]<|END_ACTION|>",
    "functionary_v3_1": "<function=get_weather>" + _ARGS + "</function>",
    "functionary_v3_2": ">>>get_weather\n" + _ARGS,
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" +
               _ARGS + "<|tool_call_end|><|tool_calls_section_end|>",
    "gpt_oss": "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + _ARGS,
}
FAMILIES: dict[str, ChatFormat] = {
    "generic": formats.GENERIC, "hermes (qwen3)": formats.QWEN3, "qwen3_coder": formats.QWEN3_CODER_THINKING,
    "gpt_oss": formats.GPT_OSS, "llama3": formats.LLAMA3, "mistral": formats.MISTRAL, "magistral": formats.MAGISTRAL,
    "deepseek_r1": formats.DEEPSEEK_R1, "deepseek_v3": formats.DEEPSEEK_V3, "granite": formats.GRANITE,
    "command_r": formats.COMMAND_R, "functionary_v3_1": formats.FUNCTIONARY_V3_1,
    "functionary_v3_2": formats.FUNCTIONARY_V3_2, "kimi_k2": formats.KIMI_K2_THINKING,
}
_PROSE = ("The forecast for Paris says light rain in the morning, clearing by noon, with a high of 14 degrees; "
          "take an umbrella <b>just in case</b> and check again before you leave. ")


def sample_answer(fmt: ChatFormat, words: int = 200) -> str:
    """A typical answer in fmt: thought, content and one call (the generic envelope stands alone)."""
    prose = (_PROSE * (words // 30 + 1))[: words * 6].rsplit(" ", 1)[0] + "."
    call = CALLS[fmt.name]
    if fmt.name == "generic":
        return prose + "\n" if not fmt.reasoning else prose
    if fmt.name == "gpt_oss":
        return (f"<|channel|>analysis<|message|>{prose}<|end|><|start|>assistant<|channel|>final<|message|>{prose}"
                f"<|end|>{call}")
    if fmt.name == "functionary_v3_2":
        return f"all\n{prose}{call}"
    thought = f"{fmt.think_start}{prose}{fmt.think_end}\n\n" if fmt.reasoning else ""
    return f"{thought}{prose}\n{call}"


def push_cost_us(fmt: ChatFormat, text: str, chunk: int = 4, repeat: int = 20) -> tuple[float, int]:
    """Mean microseconds per push (finish counted in), over repeat parses; and the pushes per answer."""
    chunks = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        parser = AnswerParser(fmt, TOOLS)
        for c in chunks:
            parser.push(c)
        parser.finish()
        best = min(best, time.perf_counter() - t0)
    return best / len(chunks) * 1e6, len(chunks)


def main(argv: list[str] | None = None) -> int:
    """Prints us/token per family for a typical answer and for a long one (no cost growing with the answer)."""
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    del args
    print(f"{'family':18} {'us/token':>9} {'tokens':>7} {'us/token (4x longer)':>21}")
    for label, fmt in FAMILIES.items():
        cost, tokens = push_cost_us(fmt, sample_answer(fmt))
        long_cost, _ = push_cost_us(fmt, sample_answer(fmt, words=800))
        print(f"{label:18} {cost:9.2f} {tokens:7d} {long_cost:21.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
