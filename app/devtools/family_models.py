"""Test doubles of the model families a household runs, and the scripted answers they are made to give.

A family's double is a tiny random-weight GGUF (app/devtools/gguf_shapes.py) carrying that family's
real tokenizer (one of llama.cpp's models/ggml-vocab-*.gguf, vocabulary only) and its real chat
template (models/templates/*.jinja), both from the llama.cpp tree vendored in the pinned
llama-cpp-python sdist. Where the vocabulary lacks the family's markup tokens (no o200k vocabulary
for gpt-oss's <|channel|>, no tekken one for Mistral's [TOOL_CALLS]), they are added, in a
placeholder slot ([PAD…], <|reserved_special_token_…|>) where the vocabulary has one, else at the
end, with the type the real model gives them: the markup is then one special token, as in the real
model, and a runner must render it for the answer parser to see it.

The weights are noise, so what the model says is decided by a grammar: script_gbnf() spells one
scripted answer (tests/data/families/<family>.json) token for token, special tokens as llama.cpp's
`<[id]>` references, so greedy decoding emits exactly the family's raw output, and every layer
above (template, rendering of special tokens, parser, stream, each API) runs for real.

Files are cached as ~/.cache/hearth/families/<family>-<hash>.gguf (the hash covers everything
that goes into one), so a test session builds each once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

from gguf.constants import GGUFValueType, TokenType

from app.devtools.gguf_shapes import Shape, Tokenizer, make_model, read_tokenizer
from app.llama_tools import BUILD_SCRIPT, tools_cache_dir

# Bump when what a family file holds changes in a way its inputs do not show.
BUILD_VERSION = 1
SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "families"
CONTROL, USER_DEFINED = int(TokenType.CONTROL), int(TokenType.USER_DEFINED)
# A vocabulary's unused special slots, which a family's markup may take (as fine-tunes do).
_PLACEHOLDER = re.compile(r"^(\[PAD\d+\]|<\|reserved_special_token_\d+\|>)$")
# One layer, 64 wide: loads in milliseconds; the vocabulary is most of the file (150k tokens: ~10 MB).
N_EMBD, N_LAYER, N_HEAD, N_HEAD_KV, N_FF, N_CTX_TRAIN = 64, 1, 4, 2, 128, 16384

_MISTRAL = (("[INST]", CONTROL), ("[/INST]", CONTROL), ("[TOOL_CALLS]", CONTROL), ("[ARGS]", CONTROL),
            ("[CALL_ID]", CONTROL), ("[AVAILABLE_TOOLS]", CONTROL), ("[/AVAILABLE_TOOLS]", CONTROL),
            ("[TOOL_RESULTS]", CONTROL), ("[/TOOL_RESULTS]", CONTROL), ("[TOOL_CONTENT]", CONTROL),
            ("[SYSTEM_PROMPT]", CONTROL), ("[/SYSTEM_PROMPT]", CONTROL), ("[IMG]", CONTROL))
_QWEN = (("<think>", USER_DEFINED), ("</think>", USER_DEFINED), ("<tool_call>", USER_DEFINED),
         ("</tool_call>", USER_DEFINED), ("<tool_response>", USER_DEFINED), ("</tool_response>", USER_DEFINED))
_DEEPSEEK = (("<｜User｜>", CONTROL), ("<｜Assistant｜>", CONTROL), ("<think>", USER_DEFINED), ("</think>", USER_DEFINED),
             ("<｜tool▁calls▁begin｜>", USER_DEFINED), ("<｜tool▁calls▁end｜>", USER_DEFINED),
             ("<｜tool▁call▁begin｜>", USER_DEFINED), ("<｜tool▁call▁end｜>", USER_DEFINED),
             ("<｜tool▁sep｜>", USER_DEFINED), ("<｜tool▁outputs▁begin｜>", USER_DEFINED),
             ("<｜tool▁outputs▁end｜>", USER_DEFINED), ("<｜tool▁output▁begin｜>", USER_DEFINED),
             ("<｜tool▁output▁end｜>", USER_DEFINED))
_LLAMA3 = (("<|eom_id|>", CONTROL), ("<|python_tag|>", CONTROL), ("<|finetune_right_pad_id|>", CONTROL))


@dataclass(frozen=True)
class Family:
    """One model family's double: where its vocabulary and template come from, and its markup tokens."""

    name: str
    fmt: str  # the answer format detect() should find in the template (C1's ChatFormat.name)
    vocab: str  # models/ggml-vocab-<vocab>.gguf
    template: str  # models/templates/<template>
    specials: tuple[tuple[str, int], ...] = ()  # (text, gguf TokenType): made one token each
    eos: str | None = None  # the token that ends a turn, where it is not the vocabulary's own eos
    reasoning: bool = False  # the family thinks (its scripts carry reasoning)
    description: str = ""


FAMILIES = {f.name: f for f in (
    Family("qwen3", "hermes", "qwen2", "Qwen-Qwen3-0.6B.jinja", _QWEN, "<|im_end|>", True,
           "Qwen3: <think> reasoning, Hermes <tool_call> JSON calls"),
    Family("qwen3_coder", "qwen3_coder", "qwen2", "Qwen3-Coder.jinja", _QWEN, "<|im_end|>", False,
           "Qwen3-Coder: XML-style <function=…><parameter=…> calls"),
    Family("gpt_oss", "gpt_oss", "gpt-2", "openai-gpt-oss-120b.jinja",
           (("<|start|>", CONTROL), ("<|end|>", CONTROL), ("<|message|>", CONTROL), ("<|channel|>", CONTROL),
            ("<|constrain|>", CONTROL), ("<|return|>", CONTROL), ("<|call|>", CONTROL)), "<|return|>", True,
           "gpt-oss: harmony channels analysis / commentary to=functions.X / final"),
    Family("llama3", "llama3", "llama-bpe", "meta-llama-Llama-3.1-8B-Instruct.jinja", _LLAMA3, "<|eot_id|>", False,
           "Llama 3.1: JSON calls {\"name\", \"parameters\"}, <|python_tag|>"),
    Family("mistral", "mistral", "llama-spm", "Mistral-Small-3.2-24B-Instruct-2506.jinja", _MISTRAL, None, False,
           "Mistral Small 3.2 / Devstral: [TOOL_CALLS]name[ARGS]{…}"),
    Family("magistral", "magistral", "llama-spm", "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
           _MISTRAL + (("[THINK]", CONTROL), ("[/THINK]", CONTROL)), None, True,
           "Magistral / Ministral reasoning: [THINK]…[/THINK], [TOOL_CALLS]name[ARGS]{…}"),
    Family("deepseek_r1", "deepseek_r1", "qwen2", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
           (("<｜begin▁of▁sentence｜>", CONTROL), ("<｜end▁of▁sentence｜>", CONTROL)) + _DEEPSEEK,
           "<｜end▁of▁sentence｜>", True,
           "DeepSeek-R1 distill (Qwen): the prompt opens <think>, calls in <｜tool▁calls▁begin｜>"),
    Family("deepseek_v3", "deepseek_v3", "deepseek-llm", "deepseek-ai-DeepSeek-V3.1.jinja", _DEEPSEEK, None, True,
           "DeepSeek V3.1: the prompt opens <think> (thinking on, as llama-server renders it), then "
           "name<｜tool▁sep｜>{…} calls"),
    Family("granite", "granite", "gpt-2", "ibm-granite-granite-4.0.jinja",
           (("<|start_of_role|>", CONTROL), ("<|end_of_role|>", CONTROL), ("<|end_of_text|>", CONTROL),
            ("<tool_call>", USER_DEFINED), ("</tool_call>", USER_DEFINED), ("<tool_response>", USER_DEFINED),
            ("</tool_response>", USER_DEFINED)), "<|end_of_text|>", False,
           "Granite 4: <tool_call> JSON calls"),
    Family("command_r", "command_r", "command-r", "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
           (("<|START_THINKING|>", CONTROL), ("<|END_THINKING|>", CONTROL), ("<|START_ACTION|>", CONTROL),
            ("<|END_ACTION|>", CONTROL), ("<|START_RESPONSE|>", CONTROL), ("<|END_RESPONSE|>", CONTROL),
            ("<|START_TOOL_RESULT|>", CONTROL), ("<|END_TOOL_RESULT|>", CONTROL)), "<|END_OF_TURN_TOKEN|>", True,
           "Command R7B: <|START_THINKING|>, <|START_ACTION|>[…] calls, <|START_RESPONSE|>"),
    Family("functionary_v3_2", "functionary_v3_2", "llama-bpe", "meetkai-functionary-medium-v3.2.jinja", _LLAMA3,
           "<|eot_id|>", False, "Functionary v3.2: >>>name\\n{…} and >>>all\\ntext"),
    Family("gemma3", "generic", "llama-spm", "google-gemma-2-2b-it.jinja",
           (("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)), "<end_of_turn>", False,
           "Gemma (generic): no tool markup; with tools, llama.cpp's JSON envelope {\"tool_call\"…}"),
)}


def vendored_models_dir() -> Path:
    """models/ of the llama.cpp tree vendored in the pinned sdist (unpacked by the build script)."""
    src = tools_cache_dir() / "src"
    for candidate in sorted(src.glob("llama_cpp_python-*/vendor/llama.cpp/models")):
        if (candidate / "templates").is_dir():
            return candidate
    raise RuntimeError(f"no vendored llama.cpp models/ under {src}: run {BUILD_SCRIPT} first (it unpacks the sdist)")


def cache_dir() -> Path:
    """Where the family files are kept ($HEARTH_FAMILIES_CACHE, else ~/.cache/hearth/families)."""
    return Path(os.environ.get("HEARTH_FAMILIES_CACHE") or "~/.cache/hearth/families").expanduser()


def _set_special(tok: Tokenizer, text: str, kind: int, free: list[int]) -> int:
    """Make `text` one token of type `kind`: its own id if present, else a free placeholder's, else a new one."""
    tokens, types = tok.tokens, tok.types
    if text in tokens:
        i = tokens.index(text)
    elif free:
        i = free.pop(0)
        tokens[i] = text
    else:
        i = len(tokens)
        tokens.append(text)
        types.append(kind)
        scores = tok.keys.get("tokenizer.ggml.scores")
        if scores is not None:
            scores[0].append(0.0)
    types[i] = kind
    return i


def family_tokenizer(family: Family) -> tuple[Tokenizer, dict[str, int]]:
    """The family's vocabulary with its markup tokens in place, and each markup token's id."""
    tok = read_tokenizer(vendored_models_dir() / f"ggml-vocab-{family.vocab}.gguf")
    free = [i for i, t in enumerate(tok.tokens) if _PLACEHOLDER.match(t)]
    ids = {text: _set_special(tok, text, kind, free) for text, kind in family.specials}
    if family.eos is not None:
        tok.set("eos_token_id", tok.tokens.index(family.eos), GGUFValueType.UINT32)
    for text, i in enumerate_specials(tok):
        ids.setdefault(text, i)
    return tok, ids


def enumerate_specials(tok: Tokenizer) -> list[tuple[str, int]]:
    """(text, id) of every control and user-defined token but the placeholders."""
    return [(t, i) for i, (t, kind) in enumerate(zip(tok.tokens, tok.types))
            if kind in (CONTROL, USER_DEFINED) and len(t) >= 3 and not _PLACEHOLDER.match(t)]


def _digest(family: Family, template: str) -> str:
    vocab = vendored_models_dir() / f"ggml-vocab-{family.vocab}.gguf"
    h = hashlib.sha256(json.dumps([BUILD_VERSION, asdict(family), vocab.stat().st_size, N_EMBD, N_LAYER, N_FF,
                                   N_CTX_TRAIN]).encode())
    h.update(template.encode())
    return h.hexdigest()[:12]


@dataclass(frozen=True)
class FamilyModel:
    """A built family double: its GGUF and the ids of its special tokens."""

    family: Family
    path: Path
    special_ids: dict[str, int] = field(default_factory=dict)

    def gbnf(self, raw: str) -> str:
        """The grammar that makes this model emit `raw` exactly (see script_gbnf)."""
        return script_gbnf(raw, self.special_ids)


@cache
def family_model(name: str) -> FamilyModel:
    """The family's double, built into the cache the first time (a few seconds), then reused."""
    family = FAMILIES[name]
    template = (vendored_models_dir() / "templates" / family.template).read_text()
    path = cache_dir() / f"{family.name}-{_digest(family, template)}.gguf"
    # The ids beside the file: reading a 150k-token vocabulary again takes seconds.
    ids_path = path.with_suffix(".ids.json")
    if path.is_file() and ids_path.is_file():
        return FamilyModel(family, path, json.loads(ids_path.read_text()))
    tok, ids = family_tokenizer(family)
    path.parent.mkdir(parents=True, exist_ok=True)
    shape = Shape(f"{family.name}-double", tok.n_vocab, N_EMBD, N_LAYER, N_HEAD, N_HEAD_KV, N_FF, N_CTX_TRAIN,
                  10000.0, True)
    make_model(shape, path, "q8_0", seed=0, tokenizer=tok, chat_template=template)
    tmp = ids_path.with_name(ids_path.name + ".part")
    tmp.write_text(json.dumps(ids, ensure_ascii=False))
    tmp.replace(ids_path)
    return FamilyModel(family, path, ids)


def _gbnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def split_specials(raw: str, special_ids: dict[str, int]) -> list[str | int]:
    """raw as text pieces and special-token ids, the longest special text matched first."""
    names = sorted((t for t in special_ids if t), key=len, reverse=True)
    if not names:
        return [raw] if raw else []
    pattern = re.compile("|".join(re.escape(t) for t in names))
    out: list[str | int] = []
    pos = 0
    for m in pattern.finditer(raw):
        if m.start() > pos:
            out.append(raw[pos:m.start()])
        out.append(special_ids[m.group()])
        pos = m.end()
    if pos < len(raw):
        out.append(raw[pos:])
    return out


def script_gbnf(raw: str, special_ids: dict[str, int]) -> str:
    """A GBNF grammar with one sentence: raw, its special tokens as `<[id]>` (llama.cpp's token references)."""
    parts = [f"<[{p}]>" if isinstance(p, int) else _gbnf_literal(p) for p in split_specials(raw, special_ids)]
    return "root ::= " + (" ".join(parts) if parts else '""') + "\n"


@dataclass(frozen=True)
class Script:
    """One scripted answer: the raw text the model emits and how it must be split.

    expect: reasoning, content (compared without surrounding whitespace), calls ([{name, arguments}]);
    cut: the answer is cut by max_tokens inside the thought, so the reasoning that arrives must be a
    prefix of expect's reasoning (and content and calls empty).
    """

    family: str
    name: str
    raw: str
    expect: dict
    max_tokens: int = 256
    cut: bool = False

    @property
    def key(self) -> str:
        """family/name."""
        return f"{self.family}/{self.name}"


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]


def load_scripts(name: str) -> list[Script]:
    """The family's scripted answers from tests/data/families/<family>.json."""
    data = json.loads((SCRIPTS_DIR / f"{name}.json").read_text())
    return [Script(name, s["name"], s["raw"], s["expect"], s.get("max_tokens", 256), s.get("cut", False))
            for s in data["scripts"]]
