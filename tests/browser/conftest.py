"""Real-browser fixtures: Debian's chromium driven by Playwright against a real `hearth serve`
(real runner, real Gemma GGUF). Reusable by every page's browser tests:

- `served`: the session's serve — `.url`, `.token` (an API token for member "browser", class chat,
  may also use voice), `.data` (its data folder), `.client` (httpx on `.url`).
- `browser`: the launched chromium (session).
- `admin_storage`: the admin's logged-in cookies; the first run's /setup is done through the UI.
- `page`: a fresh logged-in page (1280×900) that FAILS its test at teardown if the browser logged a
  console error or a page error; `page.errors` lists them meanwhile.
- `anon_page`: the same without the admin session.
- `admin_password`: the password the setup chose.
- `shot(page, name)`: a full-page screenshot into tests/artifacts/.

Never run `playwright install`: the browser is /usr/bin/chromium, launched headless with
--no-sandbox (tests run as root).
"""

from pathlib import Path

import pytest

from tests.helpers import setup_code

ADMIN_PASSWORD = "browser admin password"
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"

if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} is absent: apt-get install -y chromium to run the browser tests",
                allow_module_level=True)


def shot(page, name: str) -> Path:
    """Save a full-page screenshot as tests/artifacts/<name>.png."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


@pytest.fixture(scope="session")
def served(start_shared_serve):
    """A real hearth serve on a fresh data folder (no admin password yet) with one API token."""
    s = start_shared_serve(settings={"runner_ctx": 1024, "runner_parallel": 4, "runner_threads": 2},
                           tokens=[("browser", "chat", ["voice"])])
    s.token = s.tokens["browser"]
    yield s
    s.stop()


@pytest.fixture(scope="session")
def admin_password():
    """The admin password set through /setup by `admin_storage`."""
    return ADMIN_PASSWORD


@pytest.fixture(scope="session")
def browser():
    """Headless Debian chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        yield b
        b.close()


# A form re-rendered with its errors answers 400/401 (wrong password, invalid field): Chromium logs
# "Failed to load resource" for that document. Only those documents are excused; a failing script,
# stylesheet, fetch or htmx request still counts as an error.
FORM_ERROR_STATUSES = (400, 401)


def _watch(page) -> list[str]:
    errors: list[str] = []
    form_errors: set[str] = set()

    def on_response(response):
        request = response.request
        if (request.resource_type == "document" and request.method == "POST"
                and response.status in FORM_ERROR_STATUSES):
            form_errors.add(response.url)

    def on_console(message):
        if message.type != "error":
            return
        url = message.location.get("url")
        if message.text.startswith("Failed to load resource") and url in form_errors:
            return
        errors.append(f"console: {message.text} ({url})")

    page.on("response", on_response)
    page.on("console", on_console)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.errors = errors
    return errors


@pytest.fixture(scope="session")
def admin_storage(browser, served):
    """The admin's cookies after the first-run setup, done through the page as an admin would."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors = _watch(page)
    page.goto(served.url + "/")
    assert page.url == served.url + "/setup", "a fresh serve must ask for the admin password first"
    shot(page, "setup")
    page.fill("input[name=setup_code]", setup_code(served.data))
    page.fill("input[name=password]", ADMIN_PASSWORD)
    page.fill("input[name=confirm]", ADMIN_PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(served.url + "/")
    assert not errors, errors
    state = context.storage_state()
    context.close()
    return state


def _page(browser, served, storage, viewport):
    context = browser.new_context(viewport=viewport, storage_state=storage, base_url=served.url)
    page = context.new_page()
    errors = _watch(page)
    yield page
    context.close()
    assert not errors, "the browser logged errors:\n" + "\n".join(errors)


@pytest.fixture
def page(browser, served, admin_storage):
    """A logged-in page; its test fails if any console or page error is logged."""
    yield from _page(browser, served, admin_storage, {"width": 1280, "height": 900})


@pytest.fixture
def anon_page(browser, served, admin_storage):
    """A page without the admin session (the admin password exists already)."""
    yield from _page(browser, served, None, {"width": 1280, "height": 900})


@pytest.fixture
def phone_page(browser, served, admin_storage):
    """A logged-in page at 390×844 (a phone)."""
    yield from _page(browser, served, admin_storage, {"width": 390, "height": 844})
