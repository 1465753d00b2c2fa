"""The Requests page: the request log, newest first, filtered by member, class, model, status and time.

Pages by keyset (a cursor naming the last row shown), so page 200 costs what page 1 does and rows
arriving meanwhile never shift what the admin is reading. Filters and cursors live in the URL:
a filtered view can be bookmarked, and the browser's back button works.
"""

from __future__ import annotations

from flask import Blueprint, current_app, render_template, request

from app.gateway.context import services
from app.web.auth import login_required
from app.web.queries import (
    PAGE_SIZE,
    RANGE_LABELS,
    QueryError,
    RequestFilters,
    filter_choices,
    parse_request_filters,
    request_count,
    request_page,
    utc_now,
)

bp = Blueprint("requests", __name__)


@bp.get("/requests")
@login_required
def index():
    """The filtered log (the whole page, or the log partial for htmx)."""
    error = None
    page = None
    try:
        filters = parse_request_filters(request.args)
    except QueryError as exc:
        error, filters = str(exc), RequestFilters(
            member=request.args.get("member", ""), class_name=request.args.get("class", ""),
            model=request.args.get("model", ""))
    with services().sessions() as s:
        if error is None:
            try:
                page = request_page(s, filters, utc_now(current_app.config.get("HEARTH_CLOCK")),
                                    before=request.args.get("before") or None, after=request.args.get("after") or None,
                                    limit=PAGE_SIZE)
            except QueryError as exc:
                error = str(exc)
        choices = filter_choices(s)
        total = request_count(s)
    ctx = {"filters": filters, "page": page, "error": error, "choices": choices, "ranges": RANGE_LABELS,
           "total": total, "raw_args": request.args}
    status = 400 if error else 200
    if request.headers.get("HX-Request") and request.headers.get("HX-Target") == "request-log":
        return render_template("requests/_log.html", **ctx), status
    return render_template("requests/index.html", **ctx), status
