"""Figures over the request log: SLO attainment per class and fairness among classes (Jain's index)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.policy import ClassPolicy
from app.store.models import TTFT_DELIVERED, RequestRecord


@dataclass(frozen=True)
class ClassFigures:
    """One class over a window: demand, service and how many requests met the class's targets."""

    name: str
    requests: int
    met: int
    completion_tokens: int
    weight: float
    # Requests the SLO can judge: all but those logged before TTFT meant the first token delivered
    # (migration 0010), whose TTFT was of another kind. None: all of them.
    judged: int | None = None
    preemptions: int = 0  # times the runner preempted this class's sequences (request log)

    @property
    def slo_attainment(self) -> float | None:
        """Share of judged requests meeting both the TTFT and TPOT targets (None without any)."""
        judged = self.requests if self.judged is None else self.judged
        return self.met / judged if judged else None


def judged_by_slo(row: RequestRecord) -> bool:
    """Whether the SLO can judge the row: its TTFT, if any, is of the delivered kind (unmarked counts as it)."""
    # Bench evidence (app.verdict) is judged by the same rule and measures its own TTFT: no kind there.
    return (getattr(row, "ttft_kind", None) or TTFT_DELIVERED) == TTFT_DELIVERED


def meets_targets(row: RequestRecord, policy: ClassPolicy) -> bool:
    """A request meets its class's SLO when it succeeded within the TTFT target and the TPOT target."""
    if row.status != "ok" or row.ttft_ms is None or not judged_by_slo(row) or row.ttft_ms > policy.ttft_target_ms:
        return False
    # One generated token has no time per output token: only TTFT applies.
    return row.tpot_ms is None or row.tpot_ms <= policy.tpot_target_ms


def jain_index(values: Iterable[float]) -> float | None:
    """Jain's fairness index (Σx)² / (n·Σx²): 1 when all equal, 1/n when one takes everything."""
    xs = [float(v) for v in values]
    if not xs:
        return None
    square_sum = sum(x * x for x in xs)
    if square_sum == 0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * square_sum)


def class_figures(session: Session, policies: dict[str, ClassPolicy], start: datetime, end: datetime) -> list[ClassFigures]:
    """Per class with requests in [start, end): requests, how many met the targets, tokens served."""
    rows = session.scalars(
        select(RequestRecord).where(RequestRecord.arrival_at >= start, RequestRecord.arrival_at < end)
    )
    acc: dict[str, list[int]] = {}
    for row in rows:
        policy = policies.get(row.class_name or "")
        if policy is None:
            continue
        a = acc.setdefault(policy.name, [0, 0, 0, 0, 0])
        a[0] += 1
        a[1] += meets_targets(row, policy)
        a[2] += row.completion_tokens or 0
        a[3] += judged_by_slo(row)
        a[4] += row.num_preemptions or 0
    return [ClassFigures(name, n, met, tokens, policies[name].weight, judged=judged, preemptions=preempted)
            for name, (n, met, tokens, judged, preempted) in sorted(acc.items())]


def fairness(figures: list[ClassFigures]) -> float | None:
    """Jain's index of weight-normalised service (generated tokens / weight) among classes with demand."""
    return jain_index(f.completion_tokens / f.weight for f in figures if f.requests and f.weight > 0)
