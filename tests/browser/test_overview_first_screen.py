"""The Overview's first screen in a real browser at 1280×800 and on a 390×844 phone, fed by a real runner through
serve: the household's questions are answered above the fold, the page is short with its sections closed, every
chart is one click away, and no legend names a metric."""

import re

import httpx

from app.telemetry.sampler import METRICS
from tests.browser.conftest import ARTIFACTS, shot

SECTIONS = ("section-throughput", "section-latency", "section-memory", "section-speculation", "section-how")
CHARTS = ("chart-gen", "chart-prompt", "chart-prompt-parts", "chart-seqs", "chart-gateway", "chart-ttft", "chart-tpot",
          "chart-queue", "chart-kv", "chart-preempt", "chart-util", "chart-mem", "chart-spec")
# Charts that have lines once a few requests were served (the others may stay empty: no drafts, no preemption).
FED = ("chart-gen", "chart-prompt", "chart-seqs", "chart-kv", "chart-ttft")
# A metric's name as a legend would show it (`kv_used_pct`); "running" and "waiting" are words as well as names.
METRIC_NAME = re.compile(r"\b(" + "|".join(sorted((m for m in METRICS if "_" in m), key=len, reverse=True)) + r")\b")
# Every drawn chart's legend labels, by chart id (uPlot writes them into .u-legend).
LEGENDS = """() => Object.fromEntries((window.Hearth && Hearth.charts || []).filter(c => c.plot).map(c =>
  [c.el.id, [...c.el.querySelectorAll('.u-legend .u-series .u-label')].map(e => e.textContent).filter(t => t !== 'Time')]))"""


def _ask(served, n: int = 4) -> None:
    with httpx.Client(base_url=served.url, timeout=120, headers={"Authorization": f"Bearer {served.token}"}) as client:
        for i in range(n):
            for klass in ("chat", "voice"):
                r = client.post("/v1/chat/completions", headers={"X-Hearth-Class": klass},
                                json={"messages": [{"role": "user", "content": f"Count to {i + 3}."}], "max_tokens": 12})
                assert r.status_code == 200, r.text


def fold(page, name: str) -> None:
    """Save what the screen shows without scrolling as tests/artifacts/<name>.png."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def _bottom(page, selector: str) -> float:
    box = page.locator(selector).bounding_box()
    assert box is not None, f"{selector} is not shown"
    return box["y"] + box["height"]


def _new_page(browser, served, admin_storage, width: int, height: int):
    """A logged-in page at width × height; its `errors` collect console errors and page errors."""
    context = browser.new_context(viewport={"width": width, "height": height}, storage_state=admin_storage,
                                  base_url=served.url)
    page = context.new_page()
    page.errors = []
    page.on("console", lambda m: page.errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(f"pageerror: {e}"))
    return context, page


def test_at_1280x800_the_first_screen_answers_and_every_chart_is_one_click_away(browser, served, admin_storage):
    _ask(served)
    context, page = _new_page(browser, served, admin_storage, 1280, 800)
    try:
        page.goto("/")
        page.wait_for_function("() => document.querySelector('#overview-usage').innerText.includes('gemma')",
                               timeout=60_000)
        health = page.locator("#overview-health").inner_text()
        assert health.startswith("Working") or " is slow" in health or "failed" in health, health
        # Health, waiting/slow per class and who uses the box: above the fold of a 1280×800 screen.
        for answer in ("#overview-health", "#overview-classes", "#overview-usage"):
            assert _bottom(page, answer) <= 800, f"{answer} ends below the fold"
        assert page.locator("#overview-devices").bounding_box()["y"] < 800
        assert page.locator("#overview-classes tr[data-class='voice']").count() == 1
        # Sections closed: the whole page is short, and no closed chart fetched anything.
        assert all(not page.locator(f"#{s}").evaluate("d => d.open") for s in SECTIONS)
        height = page.evaluate("document.scrollingElement.scrollHeight")
        assert height <= 2000, f"the Overview is {height} px tall with its sections closed"
        fold(page, "overview-fold-1280")
        shot(page, "overview-closed-1280")
        # Every chart of the old Overview is in a section: open them all and they fill.
        for s in SECTIONS:
            page.click(f"#{s} > summary")
        for chart in CHARTS:
            assert page.locator(f"#{chart}").is_visible(), chart
        assert "continuous" in page.locator("#policy").inner_text()
        for chart in FED:
            page.wait_for_function(f"() => ({LEGENDS})()['{chart}'] && ({LEGENDS})()['{chart}'].length > 0",
                                   timeout=60_000)
        legends = page.evaluate(LEGENDS)
        named = {chart: labels for chart, labels in legends.items() if any(METRIC_NAME.search(t) for t in labels)}
        assert not named, f"legends that show a metric name: {named}"
        assert all(page.locator(f"#{chart} ~ .chart-caption").count() == 1 for chart in CHARTS)
        shot(page, "overview-open-1280")
        # The sections stay open on the next visit (this browser remembers).
        page.reload()
        assert all(page.locator(f"#{s}").evaluate("d => d.open") for s in SECTIONS)
        assert not page.errors, page.errors
    finally:
        context.close()


def test_on_a_phone_the_first_screen_says_whether_it_works(browser, served, admin_storage):
    context, page = _new_page(browser, served, admin_storage, 390, 844)
    try:
        page.goto("/")
        page.wait_for_selector("#overview-health")
        assert _bottom(page, "#overview-health") <= 844
        assert page.locator("#overview-health .health-text").inner_text()
        assert page.evaluate("document.scrollingElement.scrollWidth") <= 390
        fold(page, "overview-fold-390")
        shot(page, "overview-closed-390")
        assert not page.errors, page.errors
    finally:
        context.close()
