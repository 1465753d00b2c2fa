"""LAN-open mode's guards (setting api_open_on_lan): what a tokenless request must look like, and the proxy warning.

With the API open to the LAN, any web page a family member opens could otherwise reach it: a
browser sends a `text/plain` or form POST to any address without asking first (no CORS preflight).
So a tokenless request must carry a JSON body (`Content-Type: application/json`, which a page can
send cross-site only after a preflight that serve never grants without a token), and one that a
browser marks as cross-site (`Sec-Fetch-Site: cross-site`, or an `Origin` that is neither this
server nor an origin the admin listed in api_cors_origins) is refused.

"LAN" is the client's address being private. A reverse proxy on the same host, or Docker's userland
proxy, makes every client's address the proxy's own, private one: internet clients then pass for
the LAN. `ProxyWatch` notices it (forwarding headers while proxy_hops is 0, or every request from
the container's gateway) and says so in serve's log and on the Overview and Settings pages;
`startup_warnings` says what is certain before any request (serve bound to loopback).

Host names (DNS rebinding): a page on an attacker's name that the attacker's DNS then points at the
NAS is, to the browser, same-origin with its own name, whatever `Origin` checks say. So serve answers
only to Host names that are its own: IP literals, `localhost`, this machine's names (hostname, fully
qualified name, `<hostname>.local`) and those the admin lists in allowed_hosts; any other Host is
refused (421) before anything else is done, in every mode.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
import struct
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

from app.protocols.openai import ApiError

log = logging.getLogger(__name__)

FORWARD_HEADERS = ("X-Forwarded-For", "Forwarded", "X-Real-IP")
JSON_MIMETYPE = "application/json"
# Requests seen from one address before "every request comes from the container's gateway" is said.
MIN_REQUESTS_FOR_GATEWAY_WARNING = 20
_CONTAINER_MARKERS = (Path("/.dockerenv"), Path("/run/.containerenv"))


def check_tokenless(method: str, mimetype: str, has_body: bool, headers: Mapping[str, str], host: str,
                    allowed_origins: Iterable[str]) -> None:
    """Refuse a tokenless LAN request that a web page could have sent: a non-JSON body (415), cross-site (403)."""
    if method in ("POST", "PUT", "PATCH", "DELETE") and (has_body or mimetype) and mimetype != JSON_MIMETYPE:
        raise ApiError(415, f"requests without a token must send a JSON body with 'Content-Type: {JSON_MIMETYPE}' "
                            f"(got '{mimetype or 'none'}'); send a token ('Authorization: Bearer …') otherwise",
                       param="Content-Type", code="unsupported_media_type")
    fetch_site = (headers.get("Sec-Fetch-Site") or "").lower()
    origin = headers.get("Origin")
    if fetch_site == "cross-site" or (origin and not _same_origin(origin, host, allowed_origins)):
        seen = f"Origin {origin}" if origin else "Sec-Fetch-Site: cross-site"
        raise ApiError(403, f"a request without a token from another web site ({seen}) is refused: the API is open "
                            "to the LAN only for apps, not for pages a browser opens; send a token, or the "
                            "household's admin can list the page's origin in api_cors_origins",
                       code="cross_site_refused", err_type="permission_error")


def _same_origin(origin: str, host: str, allowed_origins: Iterable[str]) -> bool:
    origin = origin.strip().rstrip("/").lower()
    if origin in {o for o in allowed_origins if o != "*"}:
        return True
    if origin == "null":
        return False
    return urlsplit(origin).netloc == host.lower()


@functools.cache
def own_host_names() -> frozenset[str]:
    """This machine's own names: hostname, fully qualified name and `<hostname>.local` (mDNS), read once."""
    names = {"localhost"}
    for name in (socket.gethostname(), socket.getfqdn()):
        name = name.strip().lower().rstrip(".")
        if name:
            names |= {name, name.split(".")[0] + ".local"}
    return frozenset(names)


def allowed_host(host: str, own: Iterable[str], extra: Iterable[str]) -> bool:
    """Whether a request's Host (name or address, with or without a port) is one serve answers to."""
    name = host.strip().lower()
    if not name:
        return True  # HTTP/1.0 without a Host: no name a browser could have rebound
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    name = name.rstrip(".")
    try:
        ipaddress.ip_address(name)
        return True  # an address is not a name anyone can rebind
    except ValueError:
        pass
    if name == "localhost" or name.endswith(".localhost") or name in own:
        return True
    for allowed in extra:
        if allowed == "*" or allowed == name or (allowed.startswith("*.") and name.endswith(allowed[1:])):
            return True
    return False


def misdirected(host: str) -> str:
    """What a client sent to a Host name serve does not answer to is told."""
    return (f"this server does not answer to the host name '{host}': use its address, its own name, or a name the "
            "household's admin lists under Settings → Network and access → Host names serve answers to "
            "(allowed_hosts, or $HEARTH_ALLOWED_HOSTS)")


def in_container() -> bool:
    """Whether serve runs in a Docker or Podman container."""
    return any(p.exists() for p in _CONTAINER_MARKERS)


def default_gateway(route_table: Path = Path("/proc/net/route")) -> str | None:
    """The IPv4 default gateway (in a container: the bridge's side, where Docker's userland proxy connects from)."""
    try:
        lines = route_table.read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) > 2 and parts[1] == "00000000":
            return socket.inet_ntoa(struct.pack("<L", int(parts[2], 16)))
    return None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def startup_warnings(open_on_lan: bool, binds: Iterable[str], proxy_hops: int) -> list[str]:
    """What serve's log says at start about LAN-open mode, before any request (empty when nothing is wrong)."""
    if not open_on_lan:
        return []
    hosts = [b.rpartition(":")[0] for b in binds if not b.startswith(("unix:", "fd://"))]
    if hosts and all(_loopback(h) for h in hosts) and proxy_hops == 0:
        return ["api_open_on_lan is on while hearth serve listens on loopback only: the LAN can reach it only "
                "through a proxy on this machine, and every client of that proxy (internet ones too) then looks "
                "like the LAN. Set proxy_hops to the proxies in front of serve, or turn api_open_on_lan off"]
    return []


class ProxyWatch:
    """Notices, from the requests themselves, a proxy that makes every client look private."""

    def __init__(self, gateway: str | None = None, container: bool | None = None):
        self._lock = threading.Lock()
        self._gateway = gateway if gateway is not None else (default_gateway() if in_container() else None)
        self._container = in_container() if container is None else container
        self._forwarded: dict[str, str] = {}  # proxy address → the forwarding header it sent
        self._by_addr: dict[str, int] = {}
        self._num_seen = 0

    def note(self, remote_addr: str | None, headers: Mapping[str, str], proxy_hops: int) -> None:
        """Look at one request that reached the API with LAN-open mode on."""
        addr = remote_addr or ""
        header = next((h for h in FORWARD_HEADERS if headers.get(h)), None)
        with self._lock:
            self._num_seen += 1
            if len(self._by_addr) < 1024:
                self._by_addr[addr] = self._by_addr.get(addr, 0) + 1
            new = header is not None and proxy_hops == 0 and addr not in self._forwarded and _private(addr)
            if new:
                self._forwarded[addr] = header
            gateway_now = self._num_seen == MIN_REQUESTS_FOR_GATEWAY_WARNING and self._gateway_text() is not None
        if new:
            log.warning("LAN-open mode: %s", self._forwarded_text(addr, header))
        if gateway_now:
            log.warning("LAN-open mode: %s", self._gateway_text())

    @staticmethod
    def _forwarded_text(addr: str, header: str) -> str:
        return (f"requests from {addr} carry {header}: a proxy forwards them, and with proxy_hops 0 every client "
                f"behind it counts as the LAN (api_open_on_lan). Set proxy_hops to the proxies in front of serve "
                "(then the client's own address is checked), or turn api_open_on_lan off")

    def warnings(self) -> list[str]:
        """What the Overview and Settings pages say now (empty when nothing was noticed)."""
        with self._lock:
            out = [self._forwarded_text(a, h) for a, h in sorted(self._forwarded.items())]
            gateway = self._gateway_text()
            return out + [gateway] if gateway else out

    def _gateway_text(self) -> str | None:
        # Called under the lock.
        only = next(iter(self._by_addr)) if len(self._by_addr) == 1 else None
        if not (self._container and only and only == self._gateway
                and self._num_seen >= MIN_REQUESTS_FOR_GATEWAY_WARNING):
            return None
        return (f"every request reaches serve from {only}, this container's gateway: Docker's userland proxy (or a "
                "port published on the host's loopback) hides the clients' own addresses, so any client looks like "
                "the LAN (api_open_on_lan). Publish the port without the userland proxy, use host networking, or "
                "turn api_open_on_lan off")


def _private(addr: str) -> bool:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    return ip.is_private or ip.is_loopback
