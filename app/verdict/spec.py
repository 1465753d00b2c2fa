"""The speculation axis of `hearth bench replay`: its arms, how each target is started with one, and their labels.

An arm is named as a model's RunnerSettings.speculation is:
  off     no drafts (`--spec-type none`)
  auto    what `hearth serve` does by default: Hearth's ngram-lookup on a hearth runner (it stands aside
          by itself when the batch fills); llama-server's own default (no flag) on a stock one
  <type>  one of app.engine.speculation.NGRAM_TYPES, passed as `--spec-type <type>`
A run's label is its target, then `+arm` when the session has a speculation axis ("continuous+off",
"continuous+ngram-lookup", "llama-server+ngram-mod", "serve+auto"): the store keeps the label, so the
arm of every stored run is read back from it (split_label) without a column of its own.
"""

from __future__ import annotations

import json

from app.residency.runner_spec import (
    HEARTH_ONLY_SPEC_TYPES,
    SPEC_AUTO,
    SPEC_AUTO_HEARTH,
    SPEC_OFF,
    SPECULATION_SETTINGS,
    spec_type_for,
    speculation_problem,
)

OFF, AUTO = SPEC_OFF, SPEC_AUTO
# The arms are the model's speculation settings, in the same words.
SPEC_ARMS = SPECULATION_SETTINGS
# The axis of the repetitive-work scenarios, and stock llama-server's arms beside it (each of its
# n-gram types the issue measured; llama-server has no ngram-lookup).
DEFAULT_SPEC = (OFF, SPEC_AUTO_HEARTH)
DEFAULT_LLAMA_SPEC = (OFF, "ngram-simple", "ngram-map-k", "ngram-mod")
SEPARATOR = "+"


class SpecAxisError(ValueError):
    """An arm the bench cannot start; the message names the arms there are."""


def parse_arms(text: str | list[str] | tuple[str, ...], llama: bool = False) -> tuple[str, ...]:
    """Comma-separated arms (or a list), checked and deduplicated in order; llama: for stock llama-server."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    for raw in items:
        arm = str(raw).strip()
        if not arm:
            continue
        if arm == "none":
            arm = OFF  # llama-server's word for it
        if arm not in SPEC_ARMS:
            raise SpecAxisError(f"unknown speculation arm {arm!r}; choose from {', '.join(SPEC_ARMS)}")
        problem = speculation_problem("llama-server", arm) if llama else None
        if problem:
            raise SpecAxisError(f"llama-server arm {arm}: {problem}")
        if arm not in out:
            out.append(arm)
    if not out:
        raise SpecAxisError(f"no speculation arm given; choose from {', '.join(SPEC_ARMS)}")
    return tuple(out)


def runner_spec_type(arm: str | None, kind: str = "hearth") -> str | None:
    """The --spec-type a runner of `kind` (hearth, llama-server) starts with in this arm; None: no flag.

    No axis (arm None): no flag, so both decode without drafts (their default), as before the axis existed."""
    if arm is None:
        return None
    if kind == "llama-server" and arm in HEARTH_ONLY_SPEC_TYPES:
        raise SpecAxisError(f"llama-server arm {arm}: {speculation_problem('llama-server', arm)}")
    return spec_type_for(kind, arm)


def serve_settings(arm: str | None, model_name: str) -> dict:
    """The settings a fresh `hearth serve` data folder gets for this arm: none for auto (its default).

    Other arms go through the runner_args setting: a --spec-type there wins over the one serve derives
    from the model's speculation setting (app.residency.runner_spec.RunnerSpec.spec_flag)."""
    if arm is None or arm == AUTO:
        return {}
    return {"runner_args": json.dumps({model_name: ["--spec-type", spec_type_for("hearth", arm),
                                                    *off_arm_args(arm)]})}


def off_arm_args(arm: str | None) -> tuple[str, ...]:
    """Extra hearth runner flags of an arm (none: every arm runs with the household's own settings).

    Tried and dropped: an off arm and drafting runners on plain weights (--no-repack), to keep near-ties from
    flipping under batched verification; through serve the code-edit answer still changed in 1 of 2 runs and
    plain weights decoded 0.89x of llama-server's speed against 0.99x repacked."""
    return ()


def label(base: str, arm: str | None) -> str:
    """A run's label: the target, then +arm when the session has a speculation axis."""
    return base if arm is None else f"{base}{SEPARATOR}{arm}"


def split_label(text: str) -> tuple[str, str | None]:
    """(target, arm) of a run's label; arm None when the session had no speculation axis."""
    base, sep, arm = text.partition(SEPARATOR)
    return (base, arm) if sep and arm in SPEC_ARMS else (text, None)


def is_off(arm: str | None) -> bool:
    """Whether a runner the bench started in this arm decodes without drafts (no axis: --spec-type none)."""
    return arm is None or arm == OFF
