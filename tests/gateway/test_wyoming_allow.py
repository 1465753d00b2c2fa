"""Who the Wyoming listener answers (app.gateway.wyoming.allowed) and what its allow-list setting takes."""

import pytest

from app.gateway.wyoming import allowed
from app.store.settings import definition


@pytest.mark.parametrize(("addr", "allow", "ok"), [
    ("192.168.1.20", "", True),  # empty: the household's private ranges and loopback
    ("127.0.0.1", "", True),
    ("::ffff:10.0.0.5", "", True),
    ("8.8.8.8", "", False),
    ("192.168.1.20", "192.168.1.0/24", True),
    ("192.168.2.20", "192.168.1.0/24, 10.0.0.7", False),
    ("10.0.0.7", "192.168.1.0/24, 10.0.0.7", True),
    ("not an address", "", False),
])
def test_the_allow_list_decides(addr, allow, ok):
    assert allowed(addr, allow) is ok


def test_the_setting_refuses_what_is_no_address_or_network():
    check = definition("wyoming_allow").check
    assert check("192.168.1.0/24, 10.0.0.7") is None and check("") is None
    assert "is no IP address or network" in check("192.168.1.0/24, kitchen")
