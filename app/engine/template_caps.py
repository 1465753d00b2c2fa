"""What a chat template supports, found as llama.cpp finds it (common/jinja/caps.cpp): by rendering probes.

llama.cpp renders a few fixed conversations and watches which input values the template reads (a system
message's content, a tool's name, a call's arguments as an object...). Here the probe inputs are dicts
that record the keys read from them, which is the same signal: a value counts as used when the template
looks it up, iterates it or serialises it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_MARKER = "STRING_MARKER"
_REASONING_MARKER = "<REASONING_CONTENT_PLACEHOLDER>"


class TrackedDict(dict):
    """A dict that records which of its keys a template read (looked up, iterated or serialised with tojson).

    Printed whole it records nothing, as llama.cpp's stats count no use when an object is printed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.used: set[str] = set()

    def __getitem__(self, key):
        self.used.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        """dict.get, recorded."""
        if key in self:
            self.used.add(key)
        return super().get(key, default)

    def items(self):
        """dict.items, every key recorded."""
        self.used.update(self.keys())
        return super().items()

    def values(self):
        """dict.values, every key recorded."""
        self.used.update(self.keys())
        return super().values()



class TrackedStr(str):
    """A probe's text content that records being read as an array (indexed or iterated) or tested for a string."""

    def __new__(cls, value: str):
        self = super().__new__(cls, value)
        self.ops: set[str] = set()
        return self

    def __iter__(self):
        self.ops.add("array_access")
        return super().__iter__()

    def __getitem__(self, key):
        if isinstance(key, int):
            self.ops.add("array_access")
        return super().__getitem__(key)


class TrackedList(list):
    """A probe's typed content that records being read as an array."""

    ops: set[str]

    def __iter__(self):
        self.ops.add("array_access")
        return super().__iter__()

    def __getitem__(self, key):
        self.ops.add("array_access")
        return super().__getitem__(key)


def string_test(value) -> bool:
    """Jinja's `is string`, which also notes that a probe's content was tested for being text."""
    if isinstance(value, TrackedStr):
        value.ops.add("test_is_string")
    return isinstance(value, str)


def mark_all_used(value) -> None:
    """Records every key of every tracked dict inside value (a template serialised it whole)."""
    if isinstance(value, TrackedDict):
        value.used.update(value.keys())
        for v in dict.values(value):
            mark_all_used(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            mark_all_used(v)


def tracked(value):
    """Plain JSON-like data as tracked dicts and lists."""
    if isinstance(value, dict):
        return TrackedDict({k: tracked(v) for k, v in value.items()})
    if isinstance(value, list):
        return [tracked(v) for v in value]
    return value


@dataclass(frozen=True)
class TemplateCaps:
    """llama.cpp's capabilities of a template (jinja::caps), which decide how messages reach it."""

    supports_string_content: bool = True
    supports_typed_content: bool = False
    supports_system_role: bool = True
    supports_tools: bool = True
    supports_tool_calls: bool = True
    supports_object_arguments: bool = False
    supports_parallel_tool_calls: bool = True
    supports_preserve_reasoning: bool = False


# A probe renders messages (and tools) with extra variables; it answers (succeeded, output).
Probe = Callable[[list, list, dict], tuple[bool, str]]

_TOOL = {"name": "tool", "type": "function", "function": {
    "name": "tool1", "description": "Tool description",
    "parameters": {"type": "object", "properties": {"arg": {"type": "string", "description": "Arg description"}},
                   "required": ["arg"]}}}


def _tool_conversation(arguments, calls: int = 1) -> list:
    call = [{"id": f"call0000{i + 1}", "type": "function", "function": {"name": "tool1", "arguments": arguments}}
            for i in range(calls)]
    return [{"role": "user", "content": "User message"},
            {"role": "assistant", "content": "", "tool_calls": call},
            {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
            {"role": "assistant", "content": "The tool response was 'tool response'"},
            {"role": "user", "content": "User message"}]


def probe_caps(render: Probe) -> TemplateCaps:
    """The template's capabilities, from llama.cpp's probe conversations rendered through `render`."""
    found: dict[str, bool] = {"supports_typed_content": False}
    content = TrackedStr(_MARKER)
    ok, out = render([TrackedDict({"role": "user", "content": content})], [], {})
    as_array = "array_access" in content.ops
    found["supports_typed_content"] = as_array
    found["supports_string_content"] = ok and not (as_array and _MARKER not in out)
    if "test_is_string" in content.ops:
        parts = TrackedList()
        parts.ops = set()
        ok, _ = render([TrackedDict({"role": "user", "content": parts})], [], {})
        found["supports_typed_content"] |= ok and "array_access" in parts.ops
    messages = tracked([{"role": "system", "content": "System message"}, {"role": "user", "content": "User message"}])
    render(messages, [], {})
    found["supports_system_role"] = "content" in messages[0].used
    found |= _tool_caps(render)
    found["supports_preserve_reasoning"] = _preserves_reasoning(render)
    return TemplateCaps(**found)


def _tool_caps(render: Probe) -> dict[str, bool]:
    """supports_tools, _tool_calls, _object_arguments and _parallel_tool_calls, as caps.cpp probes them."""
    found = {"supports_object_arguments": False}
    messages, tools = tracked(_tool_conversation({"arg": "value"})), tracked([_TOOL])
    ok, _ = render(messages, tools, {})
    if ok:
        found["supports_tools"] = "name" in tools[0]["function"].used
        found["supports_tool_calls"] = "tool_calls" in messages[1].used
        if not found["supports_tool_calls"]:
            return found | {"supports_parallel_tool_calls": True}
        arguments = dict.__getitem__(dict.__getitem__(dict.__getitem__(messages[1], "tool_calls")[0], "function"),
                                     "arguments")
        found["supports_object_arguments"] = "arg" in arguments.used
    if not found["supports_object_arguments"]:
        messages, tools = tracked(_tool_conversation('{"arg": "value"}')), tracked([_TOOL])
        ok, _ = render(messages, tools, {})
        if not ok:
            return found | {"supports_tools": False, "supports_tool_calls": False, "supports_parallel_tool_calls": False}
        found["supports_tools"] = "name" in tools[0]["function"].used
        found["supports_tool_calls"] = "tool_calls" in messages[1].used
        if not found["supports_tool_calls"]:
            return found | {"supports_parallel_tool_calls": True}
    arguments = {"arg": "value"} if found["supports_object_arguments"] else '{"arg": "value"}'
    messages = tracked(_tool_conversation(arguments, calls=2))
    ok, _ = render(messages, tracked([_TOOL]), {})
    second = dict.__getitem__(messages[1], "tool_calls")[1]
    found["supports_parallel_tool_calls"] = ok and "function" in second.used
    return found


def _preserves_reasoning(render: Probe) -> bool:
    """Whether reasoning_content deeper in the history is printed (with thinking on and preserve flags set)."""
    turn = [{"role": "user", "content": "User message"}]
    messages = [*turn, {"role": "assistant", "content": "Assistant message", "reasoning_content": _REASONING_MARKER},
                *turn, {"role": "assistant", "content": "Assistant message", "reasoning_content": "Reasoning content"},
                *turn]
    _, out = render(tracked(messages), [], {"enable_thinking": True, **preserve_reasoning_vars(True)})
    return _REASONING_MARKER in out


def preserve_reasoning_vars(enabled: bool) -> dict:
    """The variables llama.cpp sets for preserve_reasoning (each family's template reads its own name)."""
    return {"preserve_thinking": enabled, "clear_thinking": not enabled, "truncate_history_thinking": not enabled,
            "drop_thinking": not enabled}


_USER = {"role": "user", "content": "U_USER_MSG Hello END_U"}
_THOUGHT = "REASON_PART I am thinking END_R"
# Families whose reasoning llama.cpp's own handlers (not its diff analysis) know: harmony, [THINK], old Qwen.
_THINKING_MARKS = ("<|channel|>", "[THINK]", "content.split('</think>')", "'<|tool_call>call:'",
                   "Write your thoughts between <think></think> and write your response between")


def template_thinks(source: str, render: Probe) -> bool:
    """Whether llama.cpp's template analysis finds reasoning (chat-diff-analyzer's two reasoning comparisons):
    an earlier turn's reasoning_content printed, or enable_thinking changing the end of the generation prompt."""
    if any(mark in source for mark in _THINKING_MARKS):
        return True
    answer = {"role": "assistant", "content": "A_ASST_MSG I can help END_A"}
    plain = render([_USER, answer], [], {"enable_thinking": True, "add_generation_prompt": False})
    thought = render([_USER, {**answer, "reasoning_content": _THOUGHT}], [],
                     {"enable_thinking": True, "add_generation_prompt": False})
    if plain[0] and thought[0] and _THOUGHT in _difference(plain[1], thought[1])[1]:
        return True
    off, on = (render([_USER], [], {"enable_thinking": flag}) for flag in (False, True))
    if not (off[0] and on[0]):
        return False
    left, right = _difference(off[1], on[1])
    if not left.strip() and right.strip():
        return on[1].endswith(right.strip())
    if not right.strip() and left.strip():
        return off[1].endswith(left.strip())
    return left.strip() != "" and _ends_in_two_markers(off[1], on[1])


_TWO_MARKERS = re.compile(r"\s*(<[^<>\s]+>|\[[^\[\]\s]+\])\s*(<[^<>\s]+>|\[[^\[\]\s]+\])\s*")


def _ends_in_two_markers(a: str, b: str) -> bool:
    """One render is the other's tail plus an opening and a closing marker (SmolLM3's "<think>\n\n</think>")."""
    for base, extended in ((b, a), (a, b)):
        anchor = base[-64:]
        at = extended.rfind(anchor)
        if at < 0 or at + len(anchor) >= len(extended):
            continue
        if _TWO_MARKERS.fullmatch(extended[at + len(anchor):]):
            return True
    return False


def _difference(a: str, b: str) -> tuple[str, str]:
    """What differs between two texts once their common prefix and suffix are taken off: (a's part, b's part)."""
    n = min(len(a), len(b))
    start = next((i for i in range(n) if a[i] != b[i]), n)
    end = 0
    while end < n - start and a[len(a) - 1 - end] == b[len(b) - 1 - end]:
        end += 1
    return a[start:len(a) - end], b[start:len(b) - end]
