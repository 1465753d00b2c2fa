"""The dashboard in a real browser: login, live overview charts fed by a real runner, the phone
status page at 390×844, settings; no console or page error anywhere (the fixtures check)."""

import threading

import httpx

from tests.browser.conftest import shot

# Points in a chart with a value above zero (page side: Hearth.charts built by static/hearth.js).
POSITIVE_POINTS = """id => {
  const c = (window.Hearth && Hearth.charts || []).find(c => c.el.id === id);
  return c ? c.data.slice(1).flat().filter(v => v !== null && v > 0).length : -1;
}"""


def test_login_wrong_then_right_password(anon_page, served, admin_password):
    page = anon_page
    page.goto("/settings")
    assert page.url.startswith(served.url + "/login")
    page.fill("input[name=password]", "not the password")
    page.click("button[type=submit]")
    assert page.locator(".flash-bad").inner_text() == "Wrong password."
    page.fill("input[name=password]", admin_password)
    page.click("button[type=submit]")
    page.wait_for_url(served.url + "/settings")
    shot(page, "settings")
    page.click("text=Log out")
    page.wait_for_url(served.url + "/login")


def _traffic(served, stop: threading.Event, count: list[int]) -> None:
    with httpx.Client(base_url=served.url, timeout=120,
                      headers={"Authorization": f"Bearer {served.token}"}) as client:
        while not stop.is_set():
            for klass in ("chat", "voice"):
                r = client.post("/v1/chat/completions", headers={"X-Hearth-Class": klass},
                                json={"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 24})
                if r.status_code == 200:
                    count[0] += 1


def test_overview_charts_receive_live_data_from_a_real_runner(page, served):
    stop, count = threading.Event(), [0]
    sender = threading.Thread(target=_traffic, args=(served, stop, count), daemon=True)
    page.goto("/")
    assert page.locator("h1").inner_text() == "Overview"
    # The charts sit in sections a person opens (closed, a chart fetches nothing).
    for section in ("throughput", "latency", "memory", "how"):
        page.click(f"#section-{section} > summary")
    started = page.evaluate("performance.timeOrigin")
    sender.start()
    try:
        for chart in ("chart-gen", "chart-prompt", "chart-seqs", "chart-kv", "chart-gateway", "chart-ttft", "chart-tpot"):
            page.wait_for_function(f"() => ({POSITIVE_POINTS})('{chart}') > 0", timeout=120_000)
        # The tiles are refreshed by htmx without a reload: the resident model appears.
        page.wait_for_function("() => document.querySelector('#overview-tiles').innerText.includes('gemma')",
                               timeout=30_000)
        # While traffic goes on, later refreshes add points with generated tokens to the chart already drawn.
        points = page.evaluate(f"({POSITIVE_POINTS})('chart-gen')")
        page.wait_for_function(f"() => ({POSITIVE_POINTS})('chart-gen') > {points}", timeout=30_000)
    finally:
        stop.set()
        sender.join(180)
    assert count[0] > 0
    assert page.evaluate("performance.timeOrigin") == started, "the page was reloaded"
    assert "continuous" in page.locator("#policy").inner_text()
    shot(page, "overview")
    page.click("button[data-range='1h']")
    page.wait_for_url("**/?range=1h")
    page.wait_for_function(f"() => ({POSITIVE_POINTS})('chart-gen') > 0", timeout=10_000)
    shot(page, "overview-1h")


def test_status_at_390x844_without_horizontal_scroll(phone_page, served):
    page = phone_page
    page.goto("/status")
    page.wait_for_selector(".status-health")
    assert page.locator(".status-health-text").inner_text().startswith(("Up", "Degraded"))
    # After one htmx refresh, the refreshed content must fit too.
    page.evaluate("window.swaps = 0; document.body.addEventListener('htmx:afterSettle', () => window.swaps++)")
    page.wait_for_function("() => window.swaps > 0", timeout=10_000)
    assert page.evaluate("document.scrollingElement.scrollWidth") <= 390
    shot(page, "status-390x844")


def test_my_pages_fit_a_phone(phone_page):
    page = phone_page
    for path in ("/", "/settings"):
        page.goto(path)
        page.wait_for_load_state("networkidle")
        width = page.evaluate("document.scrollingElement.scrollWidth")
        assert width <= 390, f"{path} is {width} px wide at 390"
        shot(page, f"phone{path.replace('/', '-') or '-overview'}")


def test_settings_validation_in_the_browser(page):
    page.goto("/settings")
    page.fill("#f-runner_parallel", "0")
    page.click("text=Save settings")
    assert page.locator("#setting-runner_parallel .field-error").inner_text() == "runner_parallel must be at least 1 (got 0)"
    page.fill("#f-runner_parallel", "4")  # what the shared serve stored (the default is now sized, not 4)
    page.click("text=Save settings")
    # Submitting the stored values back changes nothing.
    assert page.locator(".flash").first.inner_text() == "Nothing changed."


def test_dark_mode_follows_the_system(browser, served, admin_storage):
    context = browser.new_context(viewport={"width": 1280, "height": 900}, storage_state=admin_storage,
                                  base_url=served.url, color_scheme="dark")
    page = context.new_page()
    try:
        page.goto("/")
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(20, 19, 18)"
        page.click("#section-throughput > summary")
        page.wait_for_function("() => Hearth.charts.length > 0 && Hearth.charts[0].plot !== null")
        shot(page, "overview-dark")
    finally:
        context.close()


def test_status_says_down_when_hearth_stops_answering(phone_page):
    page = phone_page
    page.goto("/status")
    page.wait_for_selector(".status-ok")
    # Every later poll fails as if hearth serve were gone.
    page.route("**/partials/status", lambda route: route.abort())
    page.wait_for_selector(".status-bad", timeout=10_000)
    assert page.locator(".status-health-text").inner_text() == "Down: Hearth is not answering"
    page.unroute("**/partials/status")
    page.wait_for_selector(".status-ok", timeout=10_000)
    page.errors.clear()  # the aborted polls are logged as network errors, on purpose here
