"""POST /hearth/hold: serve's CoreShare asks this runner to yield the cores to another runner's more urgent request.

    {"priority": 0, "for_s": 30}   pause while every request here is of a preemptible class less urgent than 0
    {"priority": null}             go on now

The engine decides per iteration (app.engine.engine.Engine.hold): a request here that is not preemptible, or as
urgent, runs at once. The answer repeats the hold and says how long the engine has been paused in all."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from werkzeug.wrappers import Request as HttpRequest
from werkzeug.wrappers import Response

from app.runner.state import RunnerState
from app.runner.transport import json_response, read_body

# A hold serve forgets to lift ends by itself: a voice request's answer is well within this.
MAX_HOLD_S = 120.0


class HoldBody(BaseModel):
    """The hold: the urgent request's class priority (None lifts it) and how long it may last at most."""

    model_config = ConfigDict(extra="forbid")
    priority: int | None = Field(None, ge=0, le=1000)
    for_s: float = Field(30.0, ge=0, le=MAX_HOLD_S)


def on_hold(state: RunnerState, req: HttpRequest) -> Response:
    """POST /hearth/hold."""
    body = read_body(req, HoldBody)
    engine = state.ready()
    engine.hold(body.priority, body.for_s)
    return json_response({"priority": body.priority, "for_s": body.for_s if body.priority is not None else 0,
                          "held_seconds_total": round(engine.counters.held_seconds_total, 3)})
