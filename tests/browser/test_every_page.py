"""Every page of the dashboard's navigation in a real browser, on a desktop and at phone width:
it loads, the console stays clean (the page fixtures fail the test otherwise) and the page itself
never scrolls sideways at 390 px (wide tables scroll inside their cards)."""

import pytest

from tests.browser.conftest import shot

PAGES = ("/", "/models", "/classes", "/requests", "/members", "/bench", "/settings", "/status")


@pytest.mark.parametrize("path", PAGES)
def test_page_loads_cleanly_on_a_desktop(page, path):
    response = page.goto(path)
    assert response.status == 200, path
    page.wait_for_load_state("networkidle")
    assert page.locator("h1, .status-wrap").first.is_visible()
    shot(page, f"page{path.replace('/', '-') if path != '/' else '-overview'}")


def test_no_page_scrolls_sideways_on_a_phone(phone_page):
    wide = {}
    for path in PAGES:
        phone_page.goto(path)
        phone_page.wait_for_load_state("networkidle")
        width = phone_page.evaluate("document.scrollingElement.scrollWidth")
        if width > 390:
            wide[path] = width
        shot(phone_page, f"phone{path.replace('/', '-') if path != '/' else '-overview'}")
    assert not wide, f"pages wider than the 390 px screen: {wide}"
