"""Constrained decoding of each family's calls: tool_choice required or named -> exactly the calls (an optional
thought first), auto -> a lazy grammar that engages at the family's call marker."""

from __future__ import annotations

import json

from app.engine.formats.base import ChatFormat
from app.engine.grammar import MAX_PARALLEL_CALLS, CallLayout, Grammar, layout_grammar

# One call object inside a JSON envelope, with the family's arguments key.
_JSON_CALL = (r'"{{" space "\"name\"" space ":" space {{name_json}} space "," space "\"{key}\"" space ":" space '
              r'{{args}} "}}" space')


def _json_call(key: str = "arguments") -> str:
    return _JSON_CALL.format(key=key)


def _more(one: str, parallel: bool, separator: str = "") -> str:
    """one, then up to MAX_PARALLEL_CALLS - 1 more when parallel calls are allowed."""
    return f"{one} ( {separator} {one} ){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else one


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


# The family's call syntax: (rules per tool, root from the calls, lazy trigger patterns).
def _layout(fmt: ChatFormat, parallel: bool) -> tuple[tuple[tuple[str, str], ...], str, tuple[str, ...]]:
    name = fmt.name
    if name == "hermes":
        one = r'"<tool_call>" "\n"? space call "\n"? "</tool_call>"'
        return (("call", _json_call()),), _more(one, parallel, r'"\n"?'), (r"(<tool_call>)",)
    if name == "qwen3_coder":
        call = r'"<tool_call>\n<function=" {name} ">\n" {params} "</function>\n</tool_call>"'
        return (("call", call),), _more("call", parallel, r'"\n"'), (r"(<tool_call>)",)
    if name == "llama3":
        # A bare JSON call, or the same after <|python_tag|> (a runner may trigger on that token).
        root = '"<|python_tag|>"? ' + _more("call", parallel, r'";" space')
        return (("call", _json_call("parameters")),), root, (r"^\s*(\{)", r"(<\|python_tag\|>)")
    if name in ("mistral", "magistral"):
        if "[ARGS]" in fmt.preserved:
            call = r'"[TOOL_CALLS]" {name} "[ARGS]" {args}'
            return (("call", call),), _more("call", parallel), (r"(\[TOOL_CALLS\])",)
        root = '"[TOOL_CALLS]" space "[" space ' + _more("call", parallel, r'"," space') + ' "]"'
        return (("call", _json_call()),), root, (r"(\[TOOL_CALLS\])",)
    if name == "deepseek_r1":
        call = r'"<｜tool▁call▁begin｜>function<｜tool▁sep｜>" {name} "\n```json\n" {args} "\n```<｜tool▁call▁end｜>"'
        root = '"<｜tool▁calls▁begin｜>" ' + _more("call", parallel, r'"\n"?') + ' "<｜tool▁calls▁end｜>"'
        return (("call", call),), root, (r"(<｜tool▁calls▁begin｜>)",)
    if name == "deepseek_v3":
        call = r'"<｜tool▁call▁begin｜>" {name} "<｜tool▁sep｜>" {args} "<｜tool▁call▁end｜>"'
        root = '"<｜tool▁calls▁begin｜>" ' + _more("call", parallel) + ' "<｜tool▁calls▁end｜>"'
        return (("call", call),), root, (r"(<｜tool▁calls▁begin｜>)",)
    if name == "granite":
        root = '"<|tool_call|>" "[" space ' + _more("call", parallel, r'"," space') + ' "]"'
        return (("call", _json_call()),), root, (r"(<\|tool_call\|>)",)
    if name == "command_r":
        call = (r'"{" space "\"tool_call_id\"" space ":" space "\"" [0-9] [0-9]? "\"" space "," space '
                r'"\"tool_name\"" space ":" space {name_json} space "," space "\"parameters\"" space ":" space '
                r'{args} "}" space')
        root = '"<|START_ACTION|>" "[" space ' + _more("call", parallel, r'"," space') + ' "]" space "<|END_ACTION|>"'
        return (("call", call),), root, (r"(<\|START_ACTION\|>)",)
    if name == "functionary_v3_1":
        call = r'"<function=" {name} ">" {args} "</function>"'
        # <|python_tag|> opens code for the python tool, which is free text.
        root = f'( {_more("call", parallel)} | "<|python_tag|>" ( [^<] | "<" [^|] )* )'
        return (("call", call),), root, (r"(<function=)", r"(<\|python_tag\|>)")
    if name == "functionary_v3_2":
        # The prompt ends with the first ">>>": the first recipient follows at once.
        call = r'{name} "\n" {args}'
        return (("call", call),), _more("call", parallel, '">>>"'), (r"(>>>)",)
    if name == "kimi_k2":
        call = (r'"<|tool_call_begin|>functions." {name} ":" [0-9] [0-9]? "<|tool_call_argument_begin|>" {args} '
                r'"<|tool_call_end|>"')
        root = '"<|tool_calls_section_begin|>" ' + _more("call", parallel) + ' "<|tool_calls_section_end|>"'
        return (("call", call),), root, (r"(<\|tool_calls_section_begin\|>)",)
    if name == "gemma4":
        call = r'"<|tool_call>call:" {name} {gemma} "<tool_call|>"'
        return (("call", call),), _more("call", parallel), (r"(<\|tool_call>call:)",)
    if name == "gpt_oss":
        # One call a turn: <|call|> ends the generation.
        call = r'"<|channel|>commentary to=functions." {name} " <|constrain|>json<|message|>" {args}'
        return (("call", call),), "call", (r"(<\|channel\|>commentary to=functions\.)",)
    # generic (and any family without call syntax): Hearth's envelope.
    root = r'"{" space "\"tool_calls\"" space ":" space "[" space ' + _more("call", parallel, r'"," space') + \
        r' "]" space "}" space'
    return (("call", _json_call()),), root, (r"^\s*(?:```(?:json)?\s*)?(\{)",)


def _thought(fmt: ChatFormat, in_thought: bool) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The thought allowed before a required call: (its expression, its rules); ("", ()) for a family that does not think."""
    if not fmt.reasoning or not fmt.think_end:
        return "", ()
    end = fmt.think_end
    # Thought text: anything but the end marker's first two characters together.
    text = f'( [^{_class(end[0])}] | {_lit(end[0])} [^{_class(end[1])}] )*'
    if fmt.name == "gpt_oss":
        close = '"<|end|><|start|>assistant"'
    else:
        close = f'{_lit(end)} [ \\t\\n]{{0,4}}'
    rules = (("thought-text", text),)
    if in_thought:
        return "thought-text " + close + " ", rules
    return f"( {_lit(fmt.think_start)} thought-text {close} )? ", rules


def _class(char: str) -> str:
    return "\\" + char if char in "[]^-\\" else char


def chosen_tools(tools: list[dict], choice) -> list[dict]:
    """The tools a call may use under tool_choice (the one named, for a named choice)."""
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        return [t for t in tools if (t.get("function") or {}).get("name") == name]
    return tools


def call_marker(fmt: ChatFormat) -> str | None:
    """The text that opens the family's calls, when it is a fixed marker (a runner may trigger on its token)."""
    return {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>", "mistral": "[TOOL_CALLS]",
            "magistral": "[TOOL_CALLS]", "deepseek_r1": "<｜tool▁calls▁begin｜>", "deepseek_v3": "<｜tool▁calls▁begin｜>",
            "granite": "<|tool_call|>", "command_r": "<|START_ACTION|>", "llama3": "<|python_tag|>",
            "kimi_k2": "<|tool_calls_section_begin|>", "gemma4": "<|tool_call>"}.get(fmt.name)


def call_grammar(fmt: ChatFormat, tools: list[dict] | None, choice, parallel: bool, *, in_thought: bool = False,
                 trigger_tokens: tuple[int, ...] = ()) -> Grammar | None:
    """The grammar for tool_choice in the family's syntax: exact for "required" or a named tool, lazy for "auto".

    None without tools or for "none". Exact grammars allow the family's thought before the call
    (`in_thought`: the prompt opened it); lazy ones engage at the call marker, or at `trigger_tokens`.
    """
    if not tools or choice == "none":
        return None
    chosen = chosen_tools(tools, choice)
    if not chosen:
        return None
    specs = [(t["function"]["name"], t["function"].get("parameters") or {}) for t in chosen]
    calls, root, patterns = _layout(fmt, parallel)
    lazy = not (choice == "required" or isinstance(choice, dict))
    if lazy:
        if fmt.name == "functionary_v3_2":
            root = '">>>" ' + root  # later recipients are announced; the grammar starts at the announcement
        return layout_grammar(specs, CallLayout(calls, root), lazy=True, trigger_patterns=patterns,
                              trigger_tokens=trigger_tokens)
    thought, rules = _thought(fmt, in_thought)
    return layout_grammar(specs, CallLayout(calls, thought + root, rules))
