"""LAN-open mode (api_open_on_lan): tokenless requests must send JSON and come from no other web site; a proxy
that makes every client look private is noticed and named, at start and on the pages."""

from pathlib import Path

import pytest

from app.gateway.context import services
from app.gateway.lan import MIN_REQUESTS_FOR_GATEWAY_WARNING, ProxyWatch, default_gateway, startup_warnings
from tests.helpers import set_up_admin

LAN = {"REMOTE_ADDR": "192.168.1.20"}
HELLO = '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}'


@pytest.fixture
def lan_open(gateway_app, set_settings):
    set_settings(api_open_on_lan=True, api_open_class="voice", api_cors_origins="http://192.168.1.5:3000")
    return gateway_app.test_client()


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x",
                                          None])
def test_a_tokenless_body_must_be_json(lan_open, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    r = lan_open.post("/v1/chat/completions", data=HELLO, headers=headers, environ_base=LAN)
    assert r.status_code == 415, r.text
    err = r.json["error"]
    assert err["code"] == "unsupported_media_type" and err["param"] == "Content-Type"
    assert "Content-Type: application/json" in err["message"]
    # The Ollama API answers in its own shape.
    r = lan_open.post("/api/chat", data=HELLO, headers=headers, environ_base=LAN)
    assert r.status_code == 415 and set(r.json) == {"error"}


@pytest.mark.parametrize("headers", [{"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                                     {"Origin": "null"}, {"Origin": "http://192.168.1.20:9999"}])
def test_a_tokenless_cross_site_request_is_refused(lan_open, headers):
    r = lan_open.post("/v1/chat/completions", data=HELLO, headers={"Content-Type": "application/json", **headers},
                      environ_base=LAN)
    assert r.status_code == 403, r.text
    assert r.json["error"]["code"] == "cross_site_refused" and "api_cors_origins" in r.json["error"]["message"]
    assert lan_open.get("/api/tags", headers=headers, environ_base=LAN).status_code == 403


@pytest.mark.parametrize("headers", [{}, {"Origin": "http://localhost"}, {"Origin": "http://192.168.1.5:3000"},
                                     {"Sec-Fetch-Site": "same-origin"}, {"Sec-Fetch-Site": "none"}])
def test_a_json_request_from_an_app_or_this_site_passes(lan_open, headers):
    # Past the guard: the body is read (an empty message list is the body's own 400), not refused as cross-site.
    r = lan_open.post("/v1/chat/completions", json={"messages": []}, headers=headers, environ_base=LAN)
    assert r.status_code == 400 and r.json["error"]["code"] != "cross_site_refused", r.text
    assert lan_open.get("/v1/models", headers=headers, environ_base=LAN).status_code == 200


def test_a_token_is_checked_as_ever_and_its_requests_need_no_json(lan_open, make_token):
    headers = {**make_token("alice"), "Content-Type": "text/plain", "Origin": "http://elsewhere.example"}
    # A token's request is the token's business (CORS decides for browsers): not refused by the LAN guard.
    r = lan_open.post("/v1/chat/completions", data="{}", headers=headers, environ_base=LAN)
    assert r.status_code == 400 and r.json["error"]["code"] not in ("unsupported_media_type", "cross_site_refused")


def test_a_proxy_forwarding_for_every_client_is_named_in_the_log_and_on_the_pages(gateway_app, set_settings, caplog):
    set_settings(api_open_on_lan=True)
    client = gateway_app.test_client()
    r = client.get("/v1/models", headers={"X-Forwarded-For": "203.0.113.7"}, environ_base={"REMOTE_ADDR": "127.0.0.1"})
    assert r.status_code == 200  # it does look like the LAN: that is the problem the warning names
    assert "requests from 127.0.0.1 carry X-Forwarded-For" in caplog.text and "proxy_hops" in caplog.text
    admin = gateway_app.test_client()
    set_up_admin(admin)
    for page in ("/", "/settings", "/members"):
        html = admin.get(page).get_data(as_text=True)
        assert "requests from 127.0.0.1 carry X-Forwarded-For" in html, page


def test_no_warning_when_the_proxy_is_trusted_or_the_lan_is_closed(gateway_app, set_settings):
    client = gateway_app.test_client()
    client.get("/v1/models", headers={"X-Forwarded-For": "203.0.113.7"}, environ_base={"REMOTE_ADDR": "127.0.0.1"})
    assert services(gateway_app).proxy_watch.warnings() == []
    watch = ProxyWatch(gateway=None, container=False)
    watch.note("127.0.0.1", {"X-Forwarded-For": "203.0.113.7"}, proxy_hops=1)
    watch.note("192.168.1.20", {}, proxy_hops=0)
    assert watch.warnings() == []


def test_every_request_from_the_containers_gateway_is_named():
    watch = ProxyWatch(gateway="172.17.0.1", container=True)
    for _ in range(MIN_REQUESTS_FOR_GATEWAY_WARNING - 1):
        watch.note("172.17.0.1", {}, proxy_hops=0)
    assert watch.warnings() == []
    watch.note("172.17.0.1", {}, proxy_hops=0)
    assert "this container's gateway" in watch.warnings()[0]
    # Clients seen with their own addresses: no userland proxy in the way.
    mixed = ProxyWatch(gateway="172.17.0.1", container=True)
    for addr in ["172.17.0.1", "192.168.1.20"] * MIN_REQUESTS_FOR_GATEWAY_WARNING:
        mixed.note(addr, {}, proxy_hops=0)
    assert mixed.warnings() == []


def test_the_default_gateway_is_read_from_the_route_table(tmp_path):
    table = tmp_path / "route"
    table.write_text("Iface\tDestination\tGateway\tFlags\n"
                     "eth0\t0011AC00\t00000000\t0001\n"
                     "eth0\t00000000\t010011AC\t0003\n")
    assert default_gateway(table) == "172.17.0.1"
    assert default_gateway(Path(tmp_path / "missing")) is None


def test_serve_bound_to_loopback_with_the_lan_open_is_a_startup_warning():
    assert "listens on loopback only" in startup_warnings(True, ["127.0.0.1:8080"], proxy_hops=0)[0]
    assert startup_warnings(True, ["0.0.0.0:8080"], proxy_hops=0) == []
    assert startup_warnings(True, ["127.0.0.1:8080"], proxy_hops=1) == []
    assert startup_warnings(False, ["127.0.0.1:8080"], proxy_hops=0) == []


# -- Host names (DNS rebinding) ---------------------------------------------------------------------

REBOUND = "http://evil.example:8080"  # an attacker's name, its DNS now pointing at the NAS


def test_a_rebound_host_name_is_refused_whatever_its_origin_says(lan_open, make_token):
    same_site = {"Origin": REBOUND, "Sec-Fetch-Site": "same-origin"}
    # LAN-open mode treated a page whose Origin equals its own (rebound) Host as same-site: 200 without a token.
    r = lan_open.get("/api/tags", headers=same_site, base_url=REBOUND, environ_base=LAN)
    assert r.status_code == 421, r.text
    assert set(r.json) == {"error"} and "evil.example" in r.json["error"]  # Ollama's shape
    r = lan_open.post("/v1/chat/completions", data=HELLO, base_url=REBOUND, environ_base=LAN,
                      headers={"Content-Type": "application/json", **same_site})
    assert r.status_code == 421
    err = r.json["error"]
    assert err["code"] == "misdirected_host" and "allowed_hosts" in err["message"]
    # A token does not make the name serve's own; the dashboard answers with a page.
    assert lan_open.get("/v1/models", headers=make_token("alice"), base_url=REBOUND).status_code == 421
    page = lan_open.get("/login", base_url=REBOUND, headers={"Accept": "text/html"})
    assert page.status_code == 421 and page.mimetype == "text/html"


@pytest.mark.parametrize("base_url", ["http://localhost", "http://127.0.0.1:8080", "http://192.168.1.10:8080",
                                      "http://[::1]:8080", "http://[fd00::5]", "http://app.localhost:3000"])
def test_addresses_and_localhost_are_answered(lan_open, base_url):
    assert lan_open.get("/v1/models", base_url=base_url, environ_base=LAN).status_code == 200


def test_the_machines_own_names_and_the_listed_ones_are_answered(lan_open, set_settings):
    import socket

    name = socket.gethostname().lower()
    for host in (name, name.split(".")[0] + ".local", socket.getfqdn().lower()):
        assert lan_open.get("/v1/models", base_url=f"http://{host}:8080", environ_base=LAN).status_code == 200, host
    assert lan_open.get("/healthz", base_url="http://nas.example.org").status_code == 421
    set_settings(allowed_hosts="nas.example.org, *.home.arpa")
    for host in ("nas.example.org", "NAS.example.org.", "hearth.home.arpa"):
        assert lan_open.get("/v1/models", base_url=f"http://{host}", environ_base=LAN).status_code == 200, host
    assert lan_open.get("/v1/models", base_url="http://home.arpa.evil.example", environ_base=LAN).status_code == 421


def test_allowed_hosts_takes_names_only(gateway_app):
    from app.store.settings import definition

    check = definition("allowed_hosts").check
    assert check("nas.example.org, *.home.arpa") is None and check("*") is None
    assert "not a host name" in check("http://nas.example.org")
    assert "not a host name" in check("nas:8080")
