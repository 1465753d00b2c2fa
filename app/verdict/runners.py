"""Which runners a bench session starts: slot counts per overlap level, KV cells per slot, and whether memory allows.

A level above the runner's slots would measure its queue, not batching at that level, so each
level runs on runners with at least as many slots as the level (the configured slots for the
levels below them). With a slot sweep (`--slots 4,8,16`) every level runs on every slot count
instead, so advice on slots rests on measured slot counts. KV cells grow with the slots: the same
cells per slot as the configured n_ctx / parallel.

Runners that serve the same levels are up together (one per mode, plus llama-server), so the
targets stay interleaved level by level; a group is stopped before the next one starts. Serial
runs one request at a time whatever its slots, and an external target cannot be restarted: each
of them measures a level once, in the first group that has it.

With a speculation axis (app.verdict.spec) every hearth mode starts once per arm, and a stock
llama-server once per llama-server arm, all up together in the group, so on and off interleave.

Before anything starts, every group is estimated (app.residency.estimate) against the memory
free now; a level whose slots do not fit runs with the most slots that do, and the plan says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from app.policy import Mode

GIB = 1024 ** 3
# Modes whose result does not depend on the runner's slots: measured once per level.
ONCE_MODES = (Mode.SERIAL.value,)


@dataclass(frozen=True)
class RunnerGroup:
    """Runners up together with the same slots and KV cells, and the levels they measure."""

    slots: int
    n_ctx: int
    levels: tuple[int, ...]
    modes: tuple[str, ...]  # hearth runner modes started for this group
    once_levels: tuple[int, ...]  # levels the once-only targets (serial, external) measure here
    llama_server: bool = False
    external: int = 0  # external targets (--target, --serve: one per serve arm) measured in this group
    estimate_bytes: int | None = None  # all of the group's runners together
    # Speculation arms: each hearth mode once per spec arm, llama-server once per llama arm; (None,): no axis.
    spec: tuple[str | None, ...] = (None,)
    llama_spec: tuple[str | None, ...] = (None,)

    def runs(self, repeats: int = 1) -> int:
        """Runs this group makes."""
        arms, llama = len(self.spec), len(self.llama_spec) if self.llama_server else 0
        per_level = {lv: sum(1 for m in self.modes if m not in ONCE_MODES) * arms + llama for lv in self.levels}
        for lv in self.once_levels:
            per_level[lv] += sum(1 for m in self.modes if m in ONCE_MODES) * arms + int(self.external)
        return sum(per_level.values()) * repeats

    def as_dict(self) -> dict:
        """For the session's constants."""
        return {"slots": self.slots, "n_ctx": self.n_ctx, "levels": list(self.levels), "modes": list(self.modes),
                "once_levels": list(self.once_levels), "llama_server": self.llama_server,
                "estimate_bytes": self.estimate_bytes, "spec": list(self.spec), "llama_spec": list(self.llama_spec)}


@dataclass(frozen=True)
class RunnerPlan:
    """The groups in start order, why some levels run with fewer slots, and what could not be measured."""

    groups: tuple[RunnerGroup, ...]
    notes: dict[int, str]  # level → why it runs with fewer slots than it asks
    skipped: tuple[str, ...]
    memory: str  # what the check compared against, in words

    def runs(self, repeats: int = 1) -> int:
        """Runs the whole session makes."""
        return sum(g.runs(repeats) for g in self.groups)

    def as_dict(self) -> dict:
        """For the session's constants."""
        return {"groups": [g.as_dict() for g in self.groups], "notes": {str(k): v for k, v in self.notes.items()},
                "skipped": list(self.skipped), "memory": self.memory}


def ctx_for(n_ctx: int, parallel: int, slots: int) -> int:
    """KV cells for `slots` slots with as many cells per slot as n_ctx gives `parallel` slots."""
    if slots == parallel:
        return n_ctx
    return -(-n_ctx // parallel) * slots


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def plan_runners(levels: list[int], modes: tuple[str, ...], parallel: int, n_ctx: int,
                 slots_axis: tuple[int, ...] | None = None, llama_server: bool = False, external: int = 0,
                 runner_bytes: Callable[[int, int], int | None] | None = None,
                 headroom_bytes: int | None = None, memory: str = "not checked",
                 spec: tuple[str | None, ...] = (None,), llama_spec: tuple[str | None, ...] = (None,)) -> RunnerPlan:
    """The runner groups for these levels: enough slots for each level (or each swept slot count), memory allowing.

    runner_bytes(n_ctx, slots) estimates one runner; None (or no headroom) skips the memory check.
    spec / llama_spec: the speculation arms of hearth runners and of llama-server ((None,): no axis).
    """
    spec, llama_spec = tuple(spec) or (None,), tuple(llama_spec) or (None,)
    n_runners = len(modes) * len(spec) + (len(llama_spec) if llama_server else 0)

    def group_bytes(slots: int) -> int | None:
        one = runner_bytes(ctx_for(n_ctx, parallel, slots), slots) if runner_bytes else None
        return None if one is None else one * n_runners

    def fits(slots: int) -> bool:
        need = group_bytes(slots)
        return need is None or headroom_bytes is None or need <= headroom_bytes

    by_slots: dict[int, list[int]] = {}
    notes: dict[int, str] = {}
    skipped: list[str] = []
    if slots_axis:
        for s in sorted(set(slots_axis)):
            if fits(s):
                by_slots[s] = sorted(levels)
            else:
                skipped.append(f"{s} slots: {n_runners} runners need {_gib(group_bytes(s))}, "
                               f"{_gib(headroom_bytes)} free ({memory})")
    else:
        for lv in sorted(set(levels)):
            want = max(parallel, lv)
            s = want
            while s > 1 and not fits(s):
                s //= 2
            if not fits(s):
                skipped.append(f"level {lv}: even 1 slot needs {_gib(group_bytes(1))} for {n_runners} runners, "
                               f"{_gib(headroom_bytes)} free ({memory})")
                continue
            if s < want:
                notes[lv] = (f"{want} slots would need {_gib(group_bytes(want))} for {n_runners} runners, "
                             f"{_gib(headroom_bytes)} free ({memory}): measured with {s}, the most that fit")
            by_slots.setdefault(s, []).append(lv)
    groups = []
    done_once: set[int] = set()
    for s in sorted(by_slots):
        lvs = tuple(by_slots[s])
        once = tuple(lv for lv in lvs if lv not in done_once)
        done_once.update(once)
        group_modes = tuple(m for m in modes if m not in ONCE_MODES or once)
        groups.append(RunnerGroup(s, ctx_for(n_ctx, parallel, s), lvs, group_modes, once, llama_server,
                                  int(external) if once else 0, group_bytes(s), spec, llama_spec))
    return RunnerPlan(tuple(groups), notes, tuple(skipped), memory)
