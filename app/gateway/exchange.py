"""One generation request's path through the gateway as one object: ticket, lease, record, timings, finish().

Whatever happens (refused, runner lost, client gone or stalled, normal end), `finish` runs once:
it releases the model lease and the class place (each in a `finally`, so a failing release never
keeps the other) and queues the request's one row for the store. What a runner's answer says about
its node (busy, failed) is reported to residency in one place, `report`, streamed or not.
"""

from __future__ import annotations

import time

from app.gateway import relay
from app.gateway.admission import MemberQueueFull, QueueFull, QueueTimeout, Ticket, TooManyPlaces
from app.gateway.auth import Principal
from app.gateway.context import Services
from app.gateway.members import MemberLimits, RateLimited, class_quota, rate_limits
from app.policy import SLO_HEADER, ClassPolicy, slo_header
from app.protocols.errors import public_text
from app.protocols.openai import ApiError
from app.store.models import TTFT_DELIVERED

CLIENT_STALLED = "client_stalled"
# A stream closed after its last chunk sat unsent this share of client_stall_s was ended by the
# server's write timeout (the client stopped reading), not by the client going away.
STALL_SHARE = 0.9


def _count(value) -> int | None:
    """A token count from a runner's timings, or None when it is absent or not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def _ms(value) -> float | None:
    """A duration from a runner's timings, or None when it is absent or not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class Exchange:
    """A request from its arrival at the gateway to its row in the request log."""

    def __init__(self, svc: Services, record: dict, arrival_s: float, principal: Principal | None = None):
        self.svc = svc
        self.record = record
        self.arrival_s = arrival_s
        # Whose limits apply: the member (or the person a trusted token names) of record["member_name"].
        self.limits = principal.limits if principal is not None else MemberLimits()
        self.ticket: Ticket | None = None
        self.policy: ClassPolicy | None = None
        self.lease = None
        # When the first generated token was handed to the client's connection (streamed) or the
        # whole answer was (not streamed): the end of TTFT.
        self.first_token_s: float | None = None
        self._finished = False
        self._cores_key: int | None = None  # its place in svc.cores while it runs on this box's CPU

    def admit(self, policy: ClassPolicy, places: int = 1) -> Ticket:
        """Wait for `places` (the request's `n` choices) in its class within its member's limits; a refusal is
        counted (429, or 400 for more choices than the member may ever run) or logged (503, it waited) and
        raised as the API's error."""
        self.policy = policy
        member = self.record.get("member_name") or ""
        settings = self.svc.settings
        try:
            self.svc.usage.check_and_count(member, rate_limits(self.limits, settings.get))
        except RateLimited as exc:
            self.svc.refusals.count(member, policy.name, exc.limit)
            raise ApiError(429, str(exc), code="member_rate_limited", err_type="rate_limit_error",
                           headers={"Retry-After": str(exc.retry_after_s)})
        quota = class_quota(self.limits, policy, float(settings.get("member_class_share")))
        try:
            self.ticket = self.svc.admission.admit(policy, member, quota, places)
        except TooManyPlaces as exc:
            self.svc.usage.uncount(member)
            self.svc.refusals.count(member, policy.name, "too_many_choices")
            raise ApiError(400, str(exc), param="n", code="n_above_limit")
        except (QueueFull, MemberQueueFull) as exc:
            # Counted, not logged: a flood of refusals must not grow the store by a row each.
            self.svc.usage.uncount(member)
            member_full = isinstance(exc, MemberQueueFull)
            self.svc.refusals.count(member, policy.name, "member_queue_full" if member_full else "class_queue_full")
            raise ApiError(429, str(exc), code="member_queue_full" if member_full else "queue_full",
                           err_type="rate_limit_error", headers={"Retry-After": str(exc.retry_after_s)})
        except QueueTimeout as exc:
            self._log(status="timeout", http_status=503, error=str(exc),
                      queue_ms=(time.monotonic() - self.arrival_s) * 1000)
            raise ApiError(503, str(exc), code="queue_timeout", err_type="unavailable_error")
        self.record["queue_ms"] = self.ticket.queue_ms
        self.record["queue_position"] = self.ticket.queue_position
        return self.ticket

    def acquire(self, model_name: str):
        """Lease a runner for the model; a failure ends the request (place released, row logged)."""
        try:
            self.lease = self.svc.router.acquire(model_name)
        except ApiError as err:
            self.finish(relay.RelayOutcome(status=err.status, error=err.message))
            raise
        self.record["runner"] = self.lease.url
        if getattr(self.lease, "local", False):  # a remote node's CPU is its own (a test's stand-in lease: none)
            self.use_cores(self.lease.url)
        return self.lease

    def use_cores(self, where: str) -> None:
        """The request runs on this box's CPU from now until finish(): on a local runner (its URL) or in serve's
        TTS process (cores.SERVE); the other runners may have to yield it (app.gateway.cores)."""
        if self.svc.cores is not None and self.policy is not None and self._cores_key is None:
            self._cores_key = self.svc.cores.enter(self.policy.priority, self.policy.preemptible, where)

    def send(self, send, url: str, forward: dict):
        """Send to the runner with the class's targets (for its scheduler); if it cannot be reached, end
        the request and answer 502."""
        headers = {SLO_HEADER: slo_header(self.policy)} if self.policy is not None else None
        try:
            return send(url, forward, headers)
        except relay.RunnerUnreachable as exc:
            self.conclude(relay.RelayOutcome(status=502, error=str(exc)))
            raise ApiError(502, f"the runner for '{self.lease.model_name}' failed ({public_text(str(exc))}); it will be restarted "
                                "on the next request", code="runner_failed", err_type="server_error")

    def ttft_ms(self) -> float | None:
        """Arrival at the gateway → first generated token sent to the client, if one was."""
        return None if self.first_token_s is None else (self.first_token_s - self.arrival_s) * 1000

    def report(self, outcome: relay.RelayOutcome) -> None:
        """Tell residency what the runner's answer says about its node: busy, failed, or nothing."""
        # Busy is a 503 (loading or full): an answer, not a failure. Failed is unreachable, lost
        # mid-stream, or a 5xx other than its own generation failure (RelayOutcome.runner_fault).
        if self.lease is None:
            return
        if outcome.status == 503 and not outcome.lost_mid_stream:
            self.svc.residency.report_busy(self.lease)
        elif outcome.runner_fault:
            self.svc.residency.report_failure(self.lease, outcome.error or f"HTTP {outcome.status}")

    def conclude(self, outcome: relay.RelayOutcome, status: str | None = None) -> None:
        """The runner's answer has ended (whole, refused, streamed or cut): report it, then finish."""
        if self._finished:
            return
        try:
            self.report(outcome)
        finally:
            self.finish(outcome, status=status)

    def finish(self, outcome: relay.RelayOutcome, status: str | None = None) -> None:
        """Release lease and place, log the row; only the first call counts."""
        if self._finished:
            return
        self._finished = True
        try:
            try:
                if self._cores_key is not None:
                    self.svc.cores.leave(self._cores_key)
            finally:
                if self.lease is not None:
                    self.lease.release()
        finally:
            if self.ticket is not None:
                self.svc.admission.release(self.ticket)
        t = outcome.timings or {}
        usage = outcome.usage or {}
        if status is None:
            status = "ok" if outcome.status == 200 and not outcome.error else "error"
        ttft = self.ttft_ms()
        if self.ticket is not None:
            # What the member's token windows count: the prompt and the answer alike cost the household.
            self.svc.usage.add_tokens(self.record.get("member_name") or "",
                                      (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0))
        self._log(
            status=status,
            http_status=outcome.status or 502,
            error=outcome.error,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            ttft_ms=ttft,
            ttft_kind=TTFT_DELIVERED if ttft is not None else None,
            tpot_ms=t.get("tpot_ms"),
            total_ms=(time.monotonic() - self.arrival_s) * 1000,
            num_preemptions=t.get("num_preemptions"),
            # llama-server's names in the final timings; absent when the request did not draft.
            draft_tokens=_count(t.get("draft_n")),
            draft_accepted=_count(t.get("draft_n_accepted")),
            # The runner's own figures (hearth runner's timings; a stock llama-server sends none): NULL without images.
            images=_count(t.get("num_images")) or None,
            image_encode_ms=_ms(t.get("image_encode_ms")) if _count(t.get("num_images")) else None,
        )

    def _log(self, **fields) -> None:
        self.svc.recorder.record_request(self.record, **fields)
