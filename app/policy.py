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
