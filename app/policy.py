"""The household's policy vocabulary, defined once: scheduling modes, runner kinds, model residency
policies, and a request class's policy."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal


class Mode(str, enum.Enum):
    """How requests share the model's execution."""

    CONTINUOUS = "continuous"  # admit whenever a slot and KV room are free (iteration-level)
    SERIAL = "serial"  # one request at a time: batching off
    STATIC = "static"  # a fixed batch, admitted only when the engine is empty


MODES = tuple(m.value for m in Mode)

RunnerKind = Literal["hearth", "llama-server"]
RUNNER_KINDS: tuple[RunnerKind, ...] = ("hearth", "llama-server")

ModelPolicy = Literal["pinned", "keep_alive", "on_demand"]
MODEL_POLICIES: tuple[ModelPolicy, ...] = ("pinned", "keep_alive", "on_demand")


# A request class's thinking default, applied to a request that does not say: leave it to the model (its
# template's own default), off (voice: Home Assistant speaks the answer), on.
ThinkingMode = Literal["model", "off", "on"]
THINKING_MODES: tuple[ThinkingMode, ...] = ("model", "off", "on")


@dataclass(frozen=True)
class ClassPolicy:
    """A household request class: priority, targets, limits and defaults."""

    name: str
    priority: int = 1
    ttft_target_ms: float = 2000
    tpot_target_ms: float = 200
    default_max_tokens: int = 512
    max_output_tokens: int = 2048
    max_concurrent: int = 4
    max_queue: int = 32
    weight: float = 1.0
    preemptible: bool = False
    queue_timeout_s: float = 60
    default_model: str | None = None
    thinking: ThinkingMode = "model"
    # May its requests draft (speculative decoding, switched by load in the runner)? Off: never.
    speculation: bool = True
    # Private: its prompts are never written to the runners' KV disk tier (they stay in memory only).
    private: bool = False


# The gateway tells the runner a request's class targets in this header (a stock llama-server ignores
# it); the engine sizes its per-iteration prefill budget and its slot preemption by them.
SLO_HEADER = "X-Hearth-Slo"


@dataclass(frozen=True)
class SloTargets:
    """What the engine needs of a request's class: its latency targets and whether it may be preempted."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    preemptible: bool = False


NO_SLO = SloTargets()


def slo_header(policy: ClassPolicy) -> str:
    """The SLO_HEADER value for a class: `ttft_ms=500; tpot_ms=100; preemptible=0`."""
    return (f"ttft_ms={policy.ttft_target_ms:g}; tpot_ms={policy.tpot_target_ms:g}; "
            f"preemptible={int(bool(policy.preemptible))}")


def parse_slo_header(value: str | None) -> SloTargets:
    """SloTargets from an SLO_HEADER value; unknown or malformed parts are ignored (NO_SLO when absent)."""
    if not value:
        return NO_SLO
    fields: dict[str, str] = {}
    for part in value.split(";"):
        key, _, raw = part.partition("=")
        fields[key.strip()] = raw.strip()

    def number(key: str) -> float | None:
        try:
            v = float(fields[key])
        except (KeyError, ValueError):
            return None
        return v if v > 0 else None

    return SloTargets(number("ttft_ms"), number("tpot_ms"), fields.get("preemptible") == "1")
