"""Replay scenarios: request classes with prompt/output length distributions and arrival patterns.

A scenario is a TOML file, shipped with Hearth (app/verdict/scenarios/) or the user's own. Two kinds:
  mix     at overlap level L, L requests drawn from the classes in proportion to their shares,
          arriving all at once, staggered, or as a seeded Poisson process;
  script  fixed streams (count, start, interval), whatever the level: e.g. background work first,
          then voice requests at a steady pace.
Prompts are real text (app.verdict.texts) cut to the drawn token count with the target's tokenizer,
except the repetitive-work kinds (code-edit, document-quote, tool-arguments): their prompt is one
whole raw completion text whose answer copies from it, for the speculative-decoding scenarios.

A scenario may name the bench defaults it is made for in a [bench] table: `modes` (hearth runner
modes), `spec` (the speculation arms of hearth runners, app.verdict.spec) and `llama_spec` (those
of a stock llama-server); the command line overrides each.
"""

from __future__ import annotations

import random
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from app.policy import MODES
from app.verdict.spec import DEFAULT_LLAMA_SPEC, SpecAxisError, parse_arms
from app.verdict.texts import PASSAGES, REPEAT_KINDS, repeat_prompt

ARRIVAL_PATTERNS = ("all_at_once", "staggered", "poisson")
# What a request of each text kind asks, and which passages its material is cut from.
TEXT_KINDS: dict[str, tuple[str, tuple[int, ...]]] = {
    "voice": ("Answer in one short sentence: ", (5,)),
    "chat": ("Reply to this message from a family member in a friendly way:\n\n", (7, 0, 4)),
    "documents": ("Read the document below and answer: what must the family do this week?\n\n", (1, 4, 6, 3)),
    "coding": ("Review this code, explain it and suggest improvements:\n\n", (2, 3)),
    "background": ("Summarise the following text for the household's weekly digest:\n\n", (6, 3, 1, 4, 0)),
}
# Kinds whose prompt is one whole text (app.verdict.texts.repeat_prompt), not cut to a length.
WHOLE_KINDS = REPEAT_KINDS
CHARS_PER_TOKEN = 4  # only when the target cannot tokenize: roughly right for English text


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class ClassMix:
    """One class of a mix scenario: its share of requests, prompt kind and length ranges (tokens)."""

    name: str
    share: float
    text: str
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]


@dataclass(frozen=True)
class Stream:
    """Requests of one class in a script scenario: `count` of them from start_s, interval_s apart."""

    class_name: str
    text: str
    count: int
    start_s: float
    interval_s: float
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]


@dataclass(frozen=True)
class Scenario:
    """A replay scenario as read from its file."""

    name: str
    description: str
    kind: str
    classes: tuple[ClassMix, ...] = ()
    streams: tuple[Stream, ...] = ()
    pattern: str = "all_at_once"
    stagger_ms: float = 200.0
    rate_per_s: float = 2.0
    seed: int = 7
    source: str = ""
    # The [bench] table: defaults for `hearth bench replay` (None / () where the scenario names none).
    modes: tuple[str, ...] | None = None
    spec: tuple[str, ...] = ()
    llama_spec: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlannedRequest:
    """One request to send: when (s after the run starts), its class, prompt text and output length."""

    idx: int
    class_name: str
    at_s: float
    text: str
    prompt_tokens: int
    max_tokens: int


def shipped_names() -> list[str]:
    """Names of the scenarios shipped with Hearth."""
    folder = resources.files("app.verdict").joinpath("scenarios")
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def load_scenario(name_or_path: str) -> Scenario:
    """A shipped scenario by name, or a user's TOML file by path."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise ScenarioError(f"scenario file not found: {path}")
        raw, source = path.read_text(encoding="utf-8"), str(path)
    else:
        res = resources.files("app.verdict").joinpath("scenarios", f"{name_or_path}.toml")
        if not res.is_file():
            raise ScenarioError(f"unknown scenario {name_or_path!r}; shipped: {', '.join(shipped_names())}, "
                                "or give the path of a .toml file")
        raw, source = res.read_text(encoding="utf-8"), f"shipped:{name_or_path}"
    try:
        data = tomllib.loads(raw)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{source}: not valid TOML: {exc}")
    return parse_scenario(data, source)


def _range(value, where: str) -> tuple[int, int]:
    if isinstance(value, int):
        value = [value, value]
    if (not isinstance(value, list) or len(value) != 2 or not all(isinstance(v, int) for v in value)
            or not 1 <= value[0] <= value[1]):
        raise ScenarioError(f"{where}: expected [min, max] positive integers with min ≤ max, got {value!r}")
    return value[0], value[1]


def _text(value, where: str) -> str:
    if value not in TEXT_KINDS and value not in WHOLE_KINDS:
        raise ScenarioError(f"{where}: unknown text kind {value!r}; choose from {', '.join((*TEXT_KINDS, *WHOLE_KINDS))}")
    return value


def _prompt_range(value, text: str, where: str) -> tuple[int, int]:
    """A cut kind's prompt length range; a whole kind's prompt is its text, so the range may be left out."""
    if value is None and text in WHOLE_KINDS:
        return 0, 0
    return _range(value, where)


def _bench_defaults(data: dict, source: str) -> dict:
    """The scenario's [bench] table checked: modes, spec and llama_spec."""
    bench = data.get("bench", {})
    if not isinstance(bench, dict):
        raise ScenarioError(f"{source}: [bench] must be a table")
    out: dict = {}
    if "modes" in bench:
        modes = bench["modes"]
        if not isinstance(modes, list) or not modes or any(m not in MODES for m in modes):
            raise ScenarioError(f"{source}: bench.modes must list modes out of {', '.join(MODES)}, got {modes!r}")
        out["modes"] = tuple(modes)
    for key, llama in (("spec", False), ("llama_spec", True)):
        if key in bench:
            if not isinstance(bench[key], list):
                raise ScenarioError(f"{source}: bench.{key} must be a list of speculation arms")
            try:
                out[key] = parse_arms(bench[key], llama=llama)
            except SpecAxisError as exc:
                raise ScenarioError(f"{source}: bench.{key}: {exc}")
    if "spec" in out and "llama_spec" not in out:
        out["llama_spec"] = DEFAULT_LLAMA_SPEC
    return out


def parse_scenario(data: dict, source: str = "") -> Scenario:
    """Validate a scenario's parsed TOML; every problem names the field to fix."""
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ScenarioError(f"{source}: 'name' is required")
    kind = data.get("kind", "mix")
    if kind == "mix":
        arrival = data.get("arrival", {})
        pattern = arrival.get("pattern", "all_at_once")
        if pattern not in ARRIVAL_PATTERNS:
            raise ScenarioError(f"{source}: arrival.pattern {pattern!r}; choose from {', '.join(ARRIVAL_PATTERNS)}")
        classes = []
        for i, c in enumerate(data.get("classes", [])):
            where = f"{source}: classes[{i}]"
            if not isinstance(c.get("name"), str):
                raise ScenarioError(f"{where}.name is required")
            share = c.get("share", 1)
            if not isinstance(share, (int, float)) or share <= 0:
                raise ScenarioError(f"{where}.share must be a positive number")
            text = _text(c.get("text", "chat"), f"{where}.text")
            classes.append(ClassMix(c["name"], float(share), text,
                                    _prompt_range(c.get("prompt_tokens"), text, f"{where}.prompt_tokens"),
                                    _range(c.get("output_tokens"), f"{where}.output_tokens")))
        if not classes:
            raise ScenarioError(f"{source}: a mix scenario needs at least one [[classes]] table")
        rate = float(arrival.get("rate_per_s", 2.0))
        if rate <= 0:
            raise ScenarioError(f"{source}: arrival.rate_per_s must be positive")
        return Scenario(name, data.get("description", ""), kind, classes=tuple(classes), pattern=pattern,
                        stagger_ms=float(arrival.get("stagger_ms", 200)), rate_per_s=rate,
                        seed=int(arrival.get("seed", 7)), source=source, **_bench_defaults(data, source))
    if kind == "script":
        streams = []
        for i, s in enumerate(data.get("streams", [])):
            where = f"{source}: streams[{i}]"
            if not isinstance(s.get("class"), str):
                raise ScenarioError(f"{where}.class is required")
            count = s.get("count", 1)
            if not isinstance(count, int) or count < 1:
                raise ScenarioError(f"{where}.count must be a positive integer")
            text = _text(s.get("text", "chat"), f"{where}.text")
            streams.append(Stream(s["class"], text, count,
                                  float(s.get("start_s", 0.0)), float(s.get("interval_s", 0.0)),
                                  _prompt_range(s.get("prompt_tokens"), text, f"{where}.prompt_tokens"),
                                  _range(s.get("output_tokens"), f"{where}.output_tokens")))
        if not streams:
            raise ScenarioError(f"{source}: a script scenario needs at least one [[streams]] table")
        return Scenario(name, data.get("description", ""), kind, streams=tuple(streams),
                        seed=int(data.get("seed", 7)), source=source, **_bench_defaults(data, source))
    raise ScenarioError(f"{source}: kind {kind!r}; choose 'mix' or 'script'")


def class_order(classes: tuple[ClassMix, ...], n: int) -> list[ClassMix]:
    """n classes by smooth weighted round-robin: proportional to share, and mixed even for small n."""
    current = [0.0] * len(classes)
    total = sum(c.share for c in classes)
    out = []
    for _ in range(n):
        for i, c in enumerate(classes):
            current[i] += c.share
        best = max(range(len(classes)), key=lambda i: current[i])
        current[best] -= total
        out.append(classes[best])
    return out


def arrivals(scenario: Scenario, n: int, rng: random.Random) -> list[float]:
    """Arrival offsets (s) of n requests under the scenario's pattern."""
    if scenario.pattern == "staggered":
        return [i * scenario.stagger_ms / 1000 for i in range(n)]
    if scenario.pattern == "poisson":
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(scenario.rate_per_s)
        return out
    return [0.0] * n


class PromptCutter:
    """Cuts real text of an exact token count, using the target's tokenizer when it has one."""

    def __init__(self, tokenize: Callable[[str], list[int]] | None = None,
                 detokenize: Callable[[list[int]], str] | None = None):
        self._tokenize = tokenize
        self._detokenize = detokenize
        self._tokens: dict[tuple[int, ...], list[int]] = {}

    @property
    def exact(self) -> bool:
        """Whether lengths are counted in the target's tokens (else estimated from characters)."""
        return self._tokenize is not None and self._detokenize is not None

    def count(self, text: str) -> int:
        """Tokens in the text: counted by the target's tokenizer, else estimated from its characters."""
        if self.exact:
            return len(self._tokenize(text))
        return max(1, len(text) // CHARS_PER_TOKEN)

    def cut(self, text_kind: str, n_tokens: int, offset: int) -> str:
        """The kind's instruction followed by material of about n_tokens tokens (instruction included).

        A whole kind (WHOLE_KINDS) is its one text, whatever n_tokens: the same prompt every time, so
        the outputs of speculation on and off can be compared byte for byte."""
        if text_kind in WHOLE_KINDS:
            return repeat_prompt(text_kind)
        instruction, passages = TEXT_KINDS[text_kind]
        material = "\n\n".join(PASSAGES[i] for i in passages)
        # Repeated until long enough for the longest prompt a scenario may ask.
        if self.exact:
            head = len(self._tokenize(instruction))
            key = passages
            if key not in self._tokens:
                self._tokens[key] = self._tokenize("\n\n".join([material] * 12))
            toks = self._tokens[key]
            need = max(1, n_tokens - head)
            while len(toks) < need * 2:
                toks = toks + toks
            start = (offset * 37) % max(1, len(toks) - need)
            return instruction + self._detokenize(toks[start: start + need])
        need_chars = max(1, n_tokens * CHARS_PER_TOKEN - len(instruction))
        body = material
        while len(body) < need_chars * 2:
            body = body + "\n\n" + material
        start = (offset * 151) % max(1, len(body) - need_chars)
        return instruction + body[start: start + need_chars]


def plan(scenario: Scenario, level: int, cutter: PromptCutter) -> list[PlannedRequest]:
    """The requests of one run: for a mix, `level` of them; a script ignores the level."""
    rng = random.Random(f"{scenario.seed}:{level}")
    out: list[PlannedRequest] = []
    if scenario.kind == "mix":
        for idx, (cls, at_s) in enumerate(zip(class_order(scenario.classes, level),
                                             arrivals(scenario, level, rng))):
            p, o = rng.randint(*cls.prompt_tokens), rng.randint(*cls.output_tokens)
            text = cutter.cut(cls.text, p, idx + 101 * level)
            out.append(PlannedRequest(idx, cls.name, at_s, text, p or cutter.count(text), o))
        return out
    idx = 0
    for s in scenario.streams:
        for k in range(s.count):
            p, o = rng.randint(*s.prompt_tokens), rng.randint(*s.output_tokens)
            text = cutter.cut(s.text, p, idx)
            out.append(PlannedRequest(idx, s.class_name, s.start_s + k * s.interval_s, text,
                                      p or cutter.count(text), o))
            idx += 1
    return sorted(out, key=lambda r: (r.at_s, r.idx))


def script_size(scenario: Scenario) -> int:
    """Requests in one run of a script scenario."""
    return sum(s.count for s in scenario.streams)
